"""torchtitan 0.3.0's own entry point and Trainer, elastic under Tenplex.

``elastic``, ``ElasticDataLoader`` and ``TenplexCheckpointManager`` live in
:mod:`~tenplex.integrations.torchtitan.integration` (which imports torchtitan); they are loaded from here on
first use, so that the layout provider (:mod:`~tenplex.integrations.torchtitan.layout`, loaded by the
scheduler by entry point) does not import torchtitan with this package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ElasticDataLoader", "TenplexCheckpointManager", "elastic"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tenplex.integrations.torchtitan import integration as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
