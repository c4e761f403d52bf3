"""Test machinery for Tenplex's own tests and benchmarks; product code never imports it.

It is left out of the wheel (``[tool.setuptools.packages.find] exclude`` in
pyproject.toml) and out of the container image's build context
(``.dockerignore``), so nothing here can become a dependency of a deployed
component. ``tests/cluster/test_netcluster.py`` checks that no module outside
this package imports it.

- :mod:`tenplex.testing.k8s`: a real Kubernetes control plane on 127.0.0.1 (kube-apiserver, etcd,
  controller-manager, scheduler from ``make k8s-testbed``) and test kubelets running pods as processes.
- :mod:`tenplex.testing.netcluster`: a multi-host cluster emulated on one Linux
  machine with network namespaces, veth links into a bridge, ``tc`` shaping and
  per-link byte counters (needs root).
- :mod:`tenplex.testing.jobstore`: the conformance suite every
  :class:`~tenplex.scheduler.state.JobStore` passes (subclassed per implementation).
- :mod:`tenplex.testing.faults`: fault injection from outside (a worker killed by
  its pid, a host's daemon and workers killed), as real failures come.
- :mod:`tenplex.testing.processes`: ending the daemons and helpers a test or benchmark started (asked, then killed).
- :mod:`tenplex.testing.layouts`: a user's own layout provider (the README's), named
  by ``module:function`` in tests.
"""
