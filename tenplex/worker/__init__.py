"""The library a training process imports to take part in an elastic Tenplex job.

- :class:`ElasticWorker` (:mod:`~tenplex.worker.session`): the glue for a training loop:
  assignment, restore, elastic batches, snapshots, collective stop, reports.
- :class:`Snapshotter` / :func:`restore`: this rank's shards into / out of the node-local store.
- :class:`ElasticSampler`: the data order driven by the PTC's dataset state.
- :class:`ControlClient`, :class:`Heartbeat`, :func:`agree_stop`: the scheduler protocol.
- :mod:`~tenplex.worker.state`: the live layout (DTensor regions, optimizer state names) and its check
  against a PTC; :func:`materialize`: a model built on ``meta`` allocated without values, for a restore; :mod:`~tenplex.worker.trainer_state`: RNG, LR scheduler, step and data position.
"""

from tenplex.errors import SchedulerUnavailable
from tenplex.worker.control import ControlClient, Heartbeat, agree_stop
from tenplex.worker.restore import RestoreResult, restore
from tenplex.worker.sampler import ElasticSampler
from tenplex.worker.session import ElasticWorker, WorkerSetup
from tenplex.worker.snapshot import SnapshotResult, Snapshotter
from tenplex.worker.state import LocalPiece, check_layout, live_pieces, materialize

__all__ = [
    "ControlClient",
    "ElasticSampler",
    "ElasticWorker",
    "Heartbeat",
    "LocalPiece",
    "RestoreResult",
    "SchedulerUnavailable",
    "SnapshotResult",
    "Snapshotter",
    "WorkerSetup",
    "agree_stop",
    "check_layout",
    "live_pieces",
    "materialize",
    "restore",
]
