"""Kubernetes integration: the ElasticJob custom resource, the scheduler's Kubernetes backend and its operator.

* ``tenplex.k8s.crd``: the ElasticJob CRD as data (the chart's ``crds/`` file is
  generated from it), validation with the same schema and CEL rules the API
  server applies, typed views of spec and status, and the pod contracts (labels,
  the downward-API store address, owner references) shared by the chart and
  the scheduler's Kubernetes backend.
* ``tenplex.k8s.settings``: what the chart tells the scheduler's Kubernetes backend
  through its environment (namespace, identity, leader election, store port, ...).
* ``tenplex.k8s.backend``, ``informer``, ``jobstore``, ``operator``: worker pods on GPU nodes,
  watched; job state in the API server; the ElasticJob operator with leader election.

The test cluster (a real kube-apiserver, etcd, controller-manager and scheduler) and the test kubelets the
tests run this against are test machinery: :mod:`tenplex.testing.k8s`.
"""
