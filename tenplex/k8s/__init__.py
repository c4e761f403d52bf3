"""Kubernetes integration: the ElasticJob custom resource and an API server emulator for tests.

``tenplex.k8s.crd`` defines the resource and the pod contracts the chart and
the scheduler's Kubernetes backend share; ``tenplex.k8s.emulator`` is an
in-process API server that the official client talks to over real HTTP.
"""
