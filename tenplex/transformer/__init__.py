"""The state transformer: minimal-movement plans from an old PTC to a new one, and their execution.

:func:`~tenplex.transformer.plan.make_plan` computes, per target host, the
destination shards and the transfers (local copies, remote pulls from the
best surviving holder, zero-fill) that build them;
:func:`~tenplex.transformer.execute.execute_host_plan` runs one host's part
against the store daemons and commits the new version atomically. The
executor is imported from its module so that planning stays free of HTTP
client imports.
"""

from tenplex.transformer.plan import (
    CHECKPOINT,
    DestShard,
    HostPlan,
    Plan,
    Transfer,
    carry_dataset,
    make_plan,
    plan_summary,
)

__all__ = [
    "CHECKPOINT",
    "DestShard",
    "HostPlan",
    "Plan",
    "Transfer",
    "carry_dataset",
    "make_plan",
    "plan_summary",
]
