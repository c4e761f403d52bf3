"""The control plane: REST API, job state machine, parallelization policy, cluster backends."""
