"""The README's main job on a GPU: every level runs (each engine freed before the next sizes
its KV cache), and batch_invariant is identical in every check."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_demo_runs_every_level_on_the_gpu():
    from detlora.entrypoints.demo import run_demo

    results = run_demo(quick=True, device="cuda", log=lambda _: None)
    assert {r.level for r in results} == {"batch_invariant", "run_to_run", "fast"}
    bi = [r for r in results if r.level == "batch_invariant"]
    assert len(bi) == 7 and all(r.differing == 0 for r in bi)
