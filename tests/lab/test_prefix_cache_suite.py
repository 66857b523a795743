"""suites.prefix_cache's workload and summary on the CPU (the timing itself needs CUDA)."""

import pytest

from benchmarks.suites.prefix_cache import PrefixPlan, Prompts, run, speedups


def test_batches_share_the_policy_and_nothing_else():
    plan = PrefixPlan.quick()
    prompts = Prompts(plan)
    a, b = prompts.batch(0), prompts.batch(1)
    assert len(a) == plan.requests and len(a[0]) == plan.shared_len + plan.unique_len
    assert all(p[: plan.shared_len] == prompts.shared for p in a + b)
    tails = {tuple(p[plan.shared_len:]) for p in a + b}
    assert len(tails) == 2 * plan.requests  # fresh suffixes in every batch
    assert prompts.batch(1) == b  # and the same ones for every engine


def test_speedups_pair_each_mode():
    runs = [{"mode": "bi", "prefix_caching": False, "requests_per_s": 10.0},
            {"mode": "bi", "prefix_caching": True, "requests_per_s": 25.0},
            {"mode": "r2r", "prefix_caching": True, "requests_per_s": 5.0}]
    assert speedups(runs) == {"bi": 2.5}


def test_needs_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        run()
