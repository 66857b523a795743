"""``short_requests_host`` runs end to end on the CPU (the tiny model, a few requests, every
workload, a server's engine loop included), so that the experiment and the stub it stands
on keep up with the engine."""

import json

import torch

from benchmarks.experiments import short_requests_host

WORKLOADS = ("one_token", "decide", "core_one_token", "core_decide")


def test_every_workload_runs_on_the_tiny_model(tmp_path):
    out = tmp_path / "host.json"
    threads = torch.get_num_threads()
    try:
        short_requests_host.main([str(out), "--model", "tiny", "--requests", "12",
                                  "--repeats", "1", "--workloads", ",".join(WORKLOADS),
                                  "--concurrency", "4"])
    finally:
        torch.set_num_threads(threads)  # main() runs the engine on one thread
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == set(WORKLOADS)
    for name, row in rows.items():
        assert row["requests"] == 12, name
        assert row["thread_cpu_us_per_request"] > 0, name
        assert row["eager_steps_per_call"] == 0, name  # every step replayed a stub graph
