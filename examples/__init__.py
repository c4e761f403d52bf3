"""Reference training jobs that use tenplex.worker."""
