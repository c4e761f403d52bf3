"""Hugging Face transformers 5.x's own ``Trainer``, elastic under Tenplex.

``TenplexTrainer`` lives in :mod:`~tenplex.integrations.transformers.trainer` (which imports transformers); it
is loaded from here on first use, so that the layout provider (:mod:`~tenplex.integrations.transformers.layout`,
loaded by the scheduler by entry point) does not import the Trainer with this package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TenplexTrainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tenplex.integrations.transformers import trainer as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
