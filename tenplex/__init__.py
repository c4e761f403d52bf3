"""Tenplex: elastic multi-dimensional-parallel training on Kubernetes."""

__version__ = "0.1.0"
