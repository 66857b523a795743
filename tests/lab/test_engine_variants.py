"""suites.engine_variants on the CPU, on a tiny model: one engine per variant, each run inside
its own patch, and suites.engine's throughput rows labelled by variant."""

import contextlib
from dataclasses import replace

from benchmarks.suites import engine as be
from benchmarks.suites.engine_variants import time_variants


def test_each_variant_runs_inside_its_patch():
    shape = replace(be.ModelShape(), hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                    intermediate=128, vocab=512, rank=4, alpha=8)
    plan = replace(be.BenchPlan(), shape=shape, prompts=2, prompt_len=5, output_len=3, trials=1)
    active: list[str] = []
    seen: list[tuple[str, list[str]]] = []

    @contextlib.contextmanager
    def patch(name):
        active.append(name)
        try:
            yield
        finally:
            active.remove(name)

    original = be.throughput_rows

    def spy(llm, mode, w, log):
        seen.append((mode, list(active)))
        return original(llm, mode, w, log)

    be.throughput_rows = spy
    try:
        rows = time_variants([("fast", "a", lambda: patch("a")),
                              ("run_to_run", "b", lambda: patch("b"))],
                             (2,), "variant", log=lambda _: None, plan=plan)
    finally:
        be.throughput_rows = original
    assert seen == [("fast:a", ["a"]), ("run_to_run:b", ["b"])] and not active
    assert [(r["mode"], r["variant"], r["batch"]) for r in rows] == [("fast", "a", 2),
                                                                     ("run_to_run", "b", 2)]
    assert all(r["output_tok_per_s"] > 0 for r in rows)
