"""Benchmarks of the engine: ``python -m inference.bench <subcommand>``.

``offline`` (:mod:`inference.bench.offline`) times the engine against Hugging Face transformers on the
same machine in the same run, and :mod:`inference.bench.roofline` measures the machine's limit.
"""
