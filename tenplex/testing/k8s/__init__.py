"""A Kubernetes to test against without a cluster (test machinery; product code never imports it).

- :mod:`tenplex.testing.k8s.emulator`: an in-process API server that the official
  client and kubectl talk to over real HTTP, behaving as kube-apiserver does where
  an operator could tell the difference.
- :mod:`tenplex.testing.k8s.kubelet`: a test kubelet running a node's pods as local
  processes (and :class:`~tenplex.testing.k8s.kubelet.NodeAgent`, a kubelet without
  containers for tests that play the container runtime through the emulator's hooks).
- :mod:`tenplex.testing.k8s.binder`: a stand-in for kube-scheduler that binds pending pods.
"""
