"""Interoperability with other checkpoint formats: PyTorch DCP export and import.

- :mod:`~tenplex.interop.keymap`: how PTC tensors (``named_parameters()`` names,
  ``optim/<param>/<state>``) become a library's checkpoint keys, with built-in
  maps (``identity``, ``torchtitan``) and user maps (``module:function``).
- :mod:`~tenplex.interop.dcp`: ``export_dcp`` writes a committed version from
  the node stores as a ``torch.distributed.checkpoint`` checkpoint;
  ``import_dcp`` writes a DCP checkpoint into the node stores as a new version
  of a given PTC.

The key maps are pure (no torch at import); the DCP module imports torch.
"""
