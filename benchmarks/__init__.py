"""The detlora lab: benchmark suites, one-off experiments and their results.

Not part of the product: nothing under ``src/`` imports it and the wheel does not ship it.
Run its modules from the repository root with ``src`` on the path, e.g.
``PYTHONPATH=src python -m benchmarks.suites.engine --out out/engine.json``.
"""
