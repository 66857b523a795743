"""One-off lab experiments, one question each: ``python -m benchmarks.experiments.NAME``."""
