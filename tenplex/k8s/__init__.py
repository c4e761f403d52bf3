"""Kubernetes integration: the ElasticJob custom resource, and a cluster to test against without one.

* ``tenplex.k8s.crd``: the ElasticJob CRD as data (the chart's ``crds/`` file is
  generated from it), validation with the same schema and CEL rules the API
  server applies, typed views of spec and status, and the pod contracts (labels,
  the downward-API store address, owner references) shared by the chart and
  the scheduler's Kubernetes backend.
* ``tenplex.k8s.settings``: what the chart tells the scheduler's Kubernetes backend
  through its environment (namespace, identity, leader election, store port, ...).
* ``tenplex.k8s.emulator``: an in-process API server that the official client
  and kubectl talk to over real HTTP (test-only; needs the ``test`` extras).
* ``tenplex.k8s.kubelet``: a test kubelet that runs a node's pods as local processes.
* ``tenplex.k8s.binder``: a test stand-in for kube-scheduler that binds pending pods.
"""
