"""How users' own trainers become elastic under Tenplex without a new training loop.

- :mod:`tenplex.integrations.torchtitan`: torchtitan 0.3.0's own entry point and ``Trainer``
  (``python -m torchtitan.train --module <pkg> --config <fn>``); the user's config function returns
  ``elastic(config)``, which sets the parallel degrees from the Tenplex assignment and puts in a Tenplex
  checkpoint manager (torchtitan's ``BaseCheckpointManager``) and keeps the data position exact.
  Layout provider ``torchtitan``: the PTC derived from the same config function on the meta device.

Hugging Face's ``Trainer`` has no integration yet: ``examples/hf`` runs transformers' model in its own loop.

Each integration imports its library when it is used, never when ``tenplex`` is imported: the scheduler
loads the layout providers by entry point, and a provider module imports torchtitan only inside the
function. Both are built on :mod:`tenplex.worker`, which custom training loops use directly.
"""
