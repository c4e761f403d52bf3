"""How users' own trainers become elastic under Tenplex without a new training loop.

- :mod:`tenplex.integrations.torchtitan`: torchtitan 0.3.0's own entry point and ``Trainer``
  (``python -m torchtitan.train --module <pkg> --config <fn>``); the user's config function returns
  ``elastic(config)``, which sets the parallel degrees from the Tenplex assignment and puts in a Tenplex
  checkpoint manager (torchtitan's ``BaseCheckpointManager``) and keeps the data position exact.
  Layout provider ``torchtitan``: the PTC derived from the same config function on the meta device.

- :mod:`tenplex.integrations.transformers`: Hugging Face transformers 5.x's own ``Trainer``: a script swaps
  ``Trainer`` for ``TenplexTrainer`` (a subclass, the same arguments), which under a Tenplex scheduler
  restores the assigned version at the start of ``train()``, trains with the Trainer's DDP on Tenplex's
  elastic sample order, snapshots and stops at step boundaries as the scheduler asks. Layout provider
  ``transformers``: the PTC of the same model (an architecture and its config fields, or a pretrained
  directory) built by transformers on the meta device.

Each integration imports its library when it is used, never when ``tenplex`` is imported: the scheduler
loads the layout providers by entry point, and a provider module imports its library only inside the
function. Both are built on :mod:`tenplex.worker`, which custom training loops use directly.
"""
