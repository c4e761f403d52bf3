"""Kubernetes integration: the ElasticJob custom resource (``crd``), the chart's settings (``settings``), the
scheduler's Kubernetes backend (``backend``, ``informer``, ``standbys``), its job store in the API server
(``jobstore``) and the ElasticJob operator with leader election (``operator``).

The test cluster and the test kubelets the tests run this against are test machinery: :mod:`tenplex.testing.k8s`.
"""
