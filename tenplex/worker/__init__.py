"""The library a training process imports to take part in an elastic Tenplex job.

- :mod:`tenplex.worker.control`: register with the scheduler, heartbeats, stop requests, reports.
- :mod:`tenplex.worker.sampler`: the elastic data sampler driven by the PTC's dataset state.
"""

from tenplex.worker.control import ControlClient, Heartbeat, SchedulerUnavailable, agree_stop
from tenplex.worker.sampler import ElasticSampler

__all__ = ["ControlClient", "ElasticSampler", "Heartbeat", "SchedulerUnavailable", "agree_stop"]
