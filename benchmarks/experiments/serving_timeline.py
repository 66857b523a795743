"""Where a served level's time goes: the engine process's loop against the clients' requests.

Starts ``detlora serve`` on the serving suite's model (the Llama-3.2-3B shape, ``--layers`` to
cut it; ``--tiny`` for a CPU run) with its engine loop traced
(``benchmarks.harness.engine_trace``), runs each ``--concurrency`` level as the serving suite
does (an untimed short run first, then the suite's requests), and writes per level: the wall
time split into the engine's steps, its waits with nothing to run (``idle``), its hand-overs
and the rest of its loop; the gaps between consecutive steps; each idle wait's length (sum,
count, p50, max) and, at its midpoint, how many client requests were open and how many of
those had their first token (open requests during an idle wait are between the clients and
the engine); and the clients' time from a request's last token to the next request of the
level being sent (``client_turnaround``).

    PYTHONPATH=src python -m benchmarks.experiments.serving_timeline OUT.json \
        [--concurrency 16,64] [--layers 28] [--tiny]
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.engine_trace import read_trace
from benchmarks.harness.serving_load import LoadRequest, run_load_processes
from benchmarks.suites import serving


def _clip(e: dict[str, Any], t0: float, t1: float) -> float:
    return max(0.0, min(e["t1"], t1) - max(e["t0"], t0))


def _stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"count": 0}
    xs = sorted(xs)
    return {"count": len(xs), "sum_s": round(sum(xs), 4),
            "p50_ms": round(1e3 * xs[len(xs) // 2], 3),
            "p90_ms": round(1e3 * xs[int(0.9 * (len(xs) - 1))], 3),
            "max_ms": round(1e3 * xs[-1], 3)}


def level_timeline(trace: list[dict[str, Any]], results: list[Any], t0: float,
                   t1: float) -> dict[str, Any]:
    """The engine's loop over [t0, t1] (monotonic) against the clients' requests."""
    wall = t1 - t0
    inside = [e for e in trace if "t1" in e and e["t1"] > t0 and e["t0"] < t1]
    steps = [e for e in inside if e["kind"] == "step"]
    idle = [e for e in inside if e["kind"] == "poll" and e["timeout"]]
    sends = [e for e in inside if e["kind"] == "send"]
    step_s = sum(_clip(e, t0, t1) for e in steps)
    idle_s = sum(_clip(e, t0, t1) for e in idle)
    send_s = sum(_clip(e, t0, t1) for e in sends)
    gaps = [b["t0"] - a["t1"] for a, b in itertools.pairwise(steps)]
    at_idle = []
    for e in idle:
        mid = (max(e["t0"], t0) + min(e["t1"], t1)) / 2
        open_ = [r for r in results if r.start <= mid < r.end]
        first = [r for r in open_ if r.ttft is not None and r.start + r.ttft <= mid]
        at_idle.append((len(open_), len(first)))
    lifecycle = _lifecycle(trace, results)
    return {
        "wall_s": round(wall, 4),
        "engine_step_share": round(step_s / wall, 4),
        "engine_idle_share": round(idle_s / wall, 4),
        "engine_send_share": round(send_s / wall, 4),
        "engine_rest_share": round(1 - (step_s + idle_s + send_s) / wall, 4),
        "steps": len(steps),
        "step_ms": _stats([e["t1"] - e["t0"] for e in steps]),
        "rows_per_step_mean": round(statistics.mean(e["rows"] for e in steps), 2)
        if steps else None,
        "gap_between_steps": _stats(gaps),
        "idle_waits": _stats([_clip(e, t0, t1) for e in idle]),
        "idle_waits_over_1ms": _stats([_clip(e, t0, t1) for e in idle
                                       if _clip(e, t0, t1) > 1e-3]),
        "open_requests_at_idle_mean": round(statistics.mean(a for a, _ in at_idle), 2)
        if at_idle else None,
        "streaming_requests_at_idle_mean": round(statistics.mean(b for _, b in at_idle), 2)
        if at_idle else None,
        "client_ttft": _stats([r.ttft for r in results if r.ttft is not None]),
        "request_lifecycle": lifecycle,
    }


def _lifecycle(trace: list[dict[str, Any]], results: list[Any]) -> dict[str, Any]:
    """Each request's life in segments (the engine's events matched by the answer's id):
    client send to engine receipt, receipt to first token (queue and prefill), first token to
    finish (decode), engine finish to the client's last token (delivery), last token to the
    end of the answer, and the client's turnaround to its next request."""
    at: dict[str, dict[str, float]] = {}
    for e in trace:
        if e["kind"] in ("add", "first", "finish"):
            at.setdefault(e["rid"].rsplit("-", 2)[0], {})[e["kind"]] = e["t"]
    seg: dict[str, list[float]] = {k: [] for k in (
        "to_engine", "to_first_token", "decode", "delivery", "answer_end", "turnaround")}
    by_client: dict[tuple, list[Any]] = {}
    for r in results:
        by_client.setdefault(tuple(r.client), []).append(r)
        e = at.get(r.response_id or "", {})
        if not r.ok or len(e) < 3 or r.last_token is None:
            continue
        seg["to_engine"].append(e["add"] - r.start)
        seg["to_first_token"].append(e["first"] - e["add"])
        seg["decode"].append(e["finish"] - e["first"])
        seg["delivery"].append(r.last_token - e["finish"])
        seg["answer_end"].append(r.end - r.last_token)
    for rs in by_client.values():
        rs.sort(key=lambda r: r.start)
        seg["turnaround"] += [b.start - a.end for a, b in itertools.pairwise(rs)]
    return {k: {**_stats(v), "mean_ms": round(1e3 * statistics.mean(v), 3) if v else None}
            for k, v in seg.items()}


def run(levels: list[int], plan: serving.Plan) -> dict[str, Any]:
    shape = plan.shape()
    rows = []
    with tempfile.TemporaryDirectory(prefix="detlora-timeline-") as tmp:
        root = Path(tmp)
        serving.write_assets(root, shape)
        pool = serving.requests_pool(plan, shape.vocab, max(serving.LEVELS.values()))
        trace_file = root / "engine_trace.jsonl"
        url, proc = serving.start_server(root, plan, root / "server.log",
                                         engine_trace=trace_file)
        windows = []
        try:
            warm = [LoadRequest("completion", {**b, "max_tokens": 4}) for b in pool[:32]]
            run_load_processes(url, warm, concurrency=32, processes=1, api_key=serving.KEY)
            for c in levels:
                n = serving.LEVELS.get(c, 8 * c)
                procs = serving.client_processes(c)
                warm = [LoadRequest("completion", {**b, "max_tokens": 8}) for b in pool[:c]]
                run_load_processes(url, warm, concurrency=c, processes=procs,
                                   api_key=serving.KEY, deadline_s=300)
                reqs = [LoadRequest("completion", b) for b in pool[:n]]
                results = run_load_processes(url, reqs, concurrency=c, processes=procs,
                                             api_key=serving.KEY, deadline_s=300)
                t0, t1 = min(r.start for r in results), max(r.end for r in results)
                tokens = sum(r.output_tokens for r in results if r.ok)
                windows.append((c, results, t0, t1, tokens))
                print(f"concurrency {c}: {tokens / (t1 - t0):.0f} tok/s", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        time.sleep(0.5)
        trace = read_trace(trace_file)
        for c, results, t0, t1, tokens in windows:
            row = {"concurrency": c, "output_tok_per_s": round(tokens / (t1 - t0), 1),
                   "failed": sum(not r.ok for r in results),
                   **level_timeline(trace, results, t0, t1)}
            rows.append(row)
            print(row, flush=True)
    return {"rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--tiny", action="store_true", help="the suite's tiny model on the CPU")
    args = p.parse_args()
    plan = replace(serving.Plan.smoke(), output_len=48) if args.tiny else \
        replace(serving.Plan(), layers=args.layers)
    levels = [int(x) for x in args.concurrency.split(",")]
    body = run(levels, plan)
    cmd = "python -m benchmarks.experiments.serving_timeline " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k != "out" and v not in (None, False))
    write_results(args.out, {"meta": results_meta(cmd), **body})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
