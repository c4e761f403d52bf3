"""How users' own trainers become elastic under Tenplex without a new training loop.

- :mod:`tenplex.integrations.torchtitan`: torchtitan 0.3.0's own ``Trainer``; the user's config function
  returns ``elastic(config)``. Layout provider ``torchtitan``.
- :mod:`tenplex.integrations.transformers`: Hugging Face transformers 5.x's own ``Trainer``, swapped for its
  subclass ``TenplexTrainer``. Layout provider ``transformers``.

Each integration imports its library when it is used, never when ``tenplex`` is imported: the scheduler
loads the layout providers by entry point, and a provider module imports its library only inside the
function. Both are built on :mod:`tenplex.worker`, which custom training loops use directly.
"""
