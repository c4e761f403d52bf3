"""The ground floor: what every layer of Tenplex shares, importing nothing heavier than numpy and pydantic.

- :mod:`~tenplex.core.version`: :class:`Version`, the name of one stored state of a job.
- :mod:`~tenplex.core.units`: byte quantities for people (``human_bytes``, ``parse_bytes``).
- :mod:`~tenplex.core.buffers`: page-aligned host buffers and byte views of arrays.
- :mod:`~tenplex.core.parallel`: :class:`~tenplex.core.parallel.ParallelConfig`, a job's parallel degrees and rank order.
- :mod:`~tenplex.core.protocol`: the worker <-> scheduler REST bodies and the ``TENPLEX_*``
  environment both sides read (imported as a module, it loads pydantic).

The planner, the control plane's transform client and the worker library stand on this
floor without loading the store's zarr or the daemons' FastAPI and uvicorn
(``tests/test_layering.py`` checks both).
"""

from tenplex.core.units import human_bytes, parse_bytes
from tenplex.core.version import Version

__all__ = ["Version", "human_bytes", "parse_bytes"]
