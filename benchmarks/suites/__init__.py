"""Benchmark suites: each writes one results file (``benchmarks/results/<study>.json``).

Run from the repository root: ``PYTHONPATH=src python -m benchmarks.suites.NAME --help``.
"""
