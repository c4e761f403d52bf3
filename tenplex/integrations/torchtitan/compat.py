"""torchtitan 0.3.0 on the torch Tenplex pins (2.13.0): the one call that differs.

After its first step the Trainer shortens every process group's timeout with
``torch.distributed.set_timeout(timeout, group)``, a public name newer torch
builds have; torch 2.13 has the same operation as
``torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)``.
:func:`apply` gives torch the public name when it lacks it (on any device).
"""

from __future__ import annotations

import torch.distributed as dist


def apply() -> None:
    """Idempotent; changes nothing on a torch that has ``set_timeout``."""
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout
