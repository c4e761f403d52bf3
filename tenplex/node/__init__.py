"""The node daemon: one process per node that owns the node's store and memory tier, runs the transforms and
uploads the scheduler asks for, and relays its workers' heartbeats to the scheduler.

- :mod:`~tenplex.node.daemon`: the app assembled from the routes and services below, ``serve`` (one or
  several uvicorn processes on one socket) and ``NodeDaemon`` (in a thread, for tests and embedding).
- :mod:`~tenplex.node.store_routes`: the store's HTTP routes over the node's
  :class:`~tenplex.store.local.LocalStore` (the wire format is :mod:`tenplex.store.wire`, shared with
  :class:`~tenplex.store.client.StoreClient`).
- :mod:`~tenplex.node.transforms`: the node's part of a reconfiguration (the executor of
  :mod:`tenplex.transformer.execute` run for the scheduler), its routes and records.
- :mod:`~tenplex.node.uploads`: copies of committed versions to the persistent tier, their routes and records.
- :mod:`~tenplex.node.tasks`: what transforms and uploads share: tasks recorded on the node's disk, their routes.
- :mod:`~tenplex.node.relay`: the heartbeat relay, one report per node and interval to the scheduler.
- :mod:`~tenplex.node.cli`: ``tenplex store serve``, in the ``tenplex store`` command group.

The package stands on the store and the transformer; nothing in the product imports it but the command line
(``tests/test_layering.py``). This module imports nothing, so that ``tenplex.node.cli`` loads neither FastAPI
nor zarr for ``tenplex --help``.
"""
