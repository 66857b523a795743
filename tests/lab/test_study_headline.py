"""The history row of a ``detlora study`` result keeps its per-model headline figures."""

from __future__ import annotations

from benchmarks.harness.headlines import headline


def test_study_headline_per_model():
    row = {"comparisons": 4, "changed": 1, "bits_changed": 2}
    d = {
        "meta": {"model": ["m"]}, "replay": [], "trace": {},
        "repeat": [{"model": "m", "reduction": "atomic", **row},
                   {"model": "m", "reduction": "ordered", **row, "bits_changed": 0}],
        "decisions": [{"model": "m", "reduction": "atomic", "check": "repeat", **row}],
        "cross_batch": [{"model": "m", "level": "batch_invariant", **row, "bits_changed": 0}],
        "performance": [{"model": "m", "level": "run_to_run", "reduction": "ordered",
                         "e2e_vs_atomic": r} for r in (1.01, 1.03)]
        + [{"model": "m", "level": "run_to_run", "reduction": "unsplit", "e2e_vs_atomic": 1.2}],
    }
    assert headline(d) == {"m": {
        "repeat_changed_atomic": "1/4", "repeat_bits_changed_deterministic": "0/4",
        "decisions_changed_atomic": "1/4", "cross_batch_bits_changed_batch_invariant": "0/4",
        "best_deterministic_e2e_vs_atomic": {"run_to_run/ordered": 1.02}}}
