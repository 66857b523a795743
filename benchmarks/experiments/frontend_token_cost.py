"""What the server's front end spends per streamed token, and where.

Starts ``detlora serve`` on the serving suite's tiny model (a CPU engine is fine: only the
front end's CPU is read), streams ``--requests`` completions of 48 tokens from
``--concurrency`` clients twice, and records the front end's CPU microseconds per streamed
token (from /proc) for each pass; with ``--profile FILE`` the front end runs under cProfile
and FILE gets its statistics (``python -m pstats FILE``).

    PYTHONPATH=src python -m benchmarks.experiments.frontend_token_cost OUT.json \
        [--concurrency 64] [--requests 256] [--profile FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.serving_load import LoadRequest, run_load_processes
from benchmarks.suites import serving

OUTPUT_TOKENS = 48


def _profiled_server(profile: str) -> None:
    """Run the server's process under cProfile (the suite starts it with Popen)."""
    real = subprocess.Popen

    def popen(cmd: list[str], *args: Any, **kwargs: Any) -> subprocess.Popen:
        if "serve" in cmd:
            cmd = [cmd[0], "-m", "cProfile", "-o", profile, *cmd[1:]]
        return real(cmd, *args, **kwargs)

    serving.subprocess.Popen = popen  # type: ignore[attr-defined]


def run(concurrency: int, requests: int, profile: str | None) -> dict[str, Any]:
    plan = replace(serving.Plan.smoke(), prompt_len=16, output_len=OUTPUT_TOKENS)
    shape = plan.shape()
    if profile:
        _profiled_server(profile)
    rows = []
    with tempfile.TemporaryDirectory(prefix="detlora-frontend-") as tmp:
        root = Path(tmp)
        serving.write_assets(root, shape)
        pool = serving.requests_pool(plan, shape.vocab, requests)
        url, proc = serving.start_server(root, plan, root / "server.log")
        try:
            warm = [LoadRequest("completion", {**b, "max_tokens": 4}) for b in pool[:concurrency]]
            run_load_processes(url, warm, concurrency=concurrency, processes=2,
                               api_key=serving.KEY)
            for rep in range(2):
                before, t0 = serving.server_cpu(proc), time.perf_counter()
                clients: list[float] = []
                res = run_load_processes(url, [LoadRequest("completion", b) for b in pool],
                                         concurrency=concurrency, processes=2,
                                         api_key=serving.KEY, deadline_s=600,
                                         client_cpu=clients)
                wall, after = time.perf_counter() - t0, serving.server_cpu(proc)
                tokens = sum(r.ok for r in res) * OUTPUT_TOKENS
                rows.append({
                    "pass": rep, "ok": sum(r.ok for r in res), "wall_s": round(wall, 2),
                    "output_tok_per_s": round(tokens / wall),
                    "frontend_us_per_token": round(
                        1e6 * (after["frontend"] - before["frontend"]) / tokens, 1),
                    "engine_us_per_token": round(
                        1e6 * (after["engine"] - before["engine"]) / tokens, 1),
                    "client_us_per_token": round(1e6 * sum(clients) * wall / tokens, 1)})
                print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    return {"concurrency": concurrency, "requests": requests, "output_tokens": OUTPUT_TOKENS,
            "uvloop": importlib.util.find_spec("uvloop") is not None,
            "httptools": importlib.util.find_spec("httptools") is not None, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--profile", default=None, metavar="FILE")
    args = p.parse_args(argv)
    result = run(args.concurrency, args.requests, args.profile)
    command = " ".join(["python -m benchmarks.experiments.frontend_token_cost", *sys.argv[1:]])
    write_results(args.out, {"meta": results_meta(command), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
