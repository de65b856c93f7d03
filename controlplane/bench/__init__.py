"""Benchmarks of the control plane's data path (``python -m controlplane.bench gateway``)."""
