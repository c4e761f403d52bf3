"""A real Kubernetes control plane to test against, and the node side it lacks (test machinery; product code
never imports it).

- :mod:`tenplex.testing.k8s.controlplane`: etcd, kube-apiserver, kube-controller-manager and kube-scheduler
  v1.37.2 (built by ``make k8s-testbed``) on 127.0.0.1, with TLS, Node+RBAC authorization, service-account
  tokens and an audit log of who asked for what.
- :mod:`tenplex.testing.k8s.cluster`: the cluster as tests use it (the admin's verbs, the node side a test
  plays where no kubelet runs, a reset between tests sharing one cluster).
- :mod:`tenplex.testing.k8s.kubelet`: test kubelets that register their Nodes, renew their Leases and run a
  node's pods as local processes (and :class:`~tenplex.testing.k8s.kubelet.NodeAgent`, a kubelet without
  containers for tests that report their pods' states themselves).
"""
