"""suites.multi_lora on the CPU, on a tiny model: the traffic and slot-cost parts run end to end
and give rows of the results schema; every traffic request of the Zipf run rerun alone gives
the same bits, and so does the Zipf run at another max_loras (which draws the same adapters)."""

from dataclasses import replace

from benchmarks.harness.headlines import headline
from benchmarks.suites.multi_lora import Plan, _distributions, run


def test_tiny_traffic_and_slot_cost():
    plan = replace(Plan.tiny(), adapters=10, requests=8, slot_max_loras=(2,),
                   slot_run_to_run_max_loras=(), slot_batches=(2,), traffic_vs_alone=2)
    result = run(plan, parts=("traffic", "slot_cost"), log=lambda _: None)
    traffic = result["traffic"]
    assert [(r["distribution"], r["pass"]) for r in traffic] == [
        ("single", 1), ("working_set_uniform", 1), ("working_set_uniform", 2), ("zipf", 1),
        ("zipf", 2), ("uniform", 1), ("uniform", 2)]
    for r in traffic:
        assert {"model", "adapters", "distribution", "max_loras", "output_tok_per_s",
                "vs_single"} <= set(r) and r["output_tok_per_s"] > 0
    assert traffic[0]["vs_single"] == 1.0 and traffic[-1]["adapters"] == 10
    assert sum(r["swaps"] for r in traffic) > 0
    (cost,) = result["slot_cost"]
    assert {"model", "max_loras", "batch", "level", "tpot_ms"} <= set(cost)
    # Pass 2 finds every adapter in the host cache: no disk read.
    assert all(r["disk_loads"] == 0 for r in traffic if r["pass"] == 2)
    assert result["invariance"] == [
        {"check": "working_set_uniform_pass_2_vs_1_max_loras_2", "comparisons": 8,
         "differing": 0},
        {"check": "zipf_pass_2_vs_1_max_loras_2", "comparisons": 8, "differing": 0},
        {"check": "zipf_traffic_vs_alone_max_loras_2", "comparisons": 2, "differing": 0},
        {"check": "uniform_pass_2_vs_1_max_loras_2", "comparisons": 8, "differing": 0}]
    figures = headline({**result, "meta": {}})
    assert figures["vs_single"]["zipf_max_loras_2"] == traffic[3]["vs_single"]
    assert figures["vs_single"]["zipf_max_loras_2_pass2"] == traffic[4]["vs_single"]
    assert figures["differing_outputs"] == "0/26"


def test_draws_do_not_follow_max_loras():
    """The Zipf and uniform laws pick the same adapter for every request at any max_loras
    (the max_loras 8 vs 32 comparison once compared other adapters: 495/512 'differed')."""
    plan = Plan()
    a, b = _distributions(plan, 8), _distributions(plan, 32)
    for law in ("single", "zipf", "uniform"):
        assert a[law] == b[law], law
    assert a["working_set_uniform"][0] == 48 and b["working_set_uniform"][0] == 192
    assert len(set(a["zipf"][1])) > 100


def test_zipf_traffic_at_two_max_loras_has_the_same_bits():
    plan = replace(Plan.tiny(), adapters=10, requests=8, traffic_max_loras=(1, 3),
                   traffic_vs_alone=1)
    result = run(plan, parts=("traffic",), log=lambda _: None)
    (check,) = [r for r in result["invariance"] if r["check"] == "zipf_traffic_max_loras_1_vs_3"]
    assert check == {"check": "zipf_traffic_max_loras_1_vs_3", "comparisons": 8,
                     "differing": 0}
