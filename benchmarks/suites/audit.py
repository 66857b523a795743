"""Audit log benchmark: serving with and without --audit-log, detlora verify against offline.

What ``--audit-log`` costs a server, and how fast ``detlora verify`` replays a log against
offline ``LLM.generate``.

Model and requests: the serving suite's (Llama-3.2-3B shape, random bf16 weights, two rank-16
adapters taken in turn, a word-level tokenizer; 100-token random prompts, half greedy and half
seeded sampling at temperature 0.8 / top-p 0.95, the chosen tokens' logprobs), at
``batch_invariant``.

1. Serving: ``detlora serve`` without the log, then a fresh one with ``--audit-log``; on each,
   an untimed run at the concurrency (8-token requests), then ``trials`` timed runs of
   ``requests`` requests of 150 output tokens (EOS ignored) at concurrency 64: output tok/s
   over each run's wall time (the median is the row's ``tok_s``). With the log: its lines
   written and dropped (dropped must stay 0), then, after SIGTERM, ``detlora verify`` of the
   served log (every request identical expected; ``vs_offline`` null: no offline run of
   those requests is timed).
2. Verify: ``verify_requests`` requests (32 output tokens) through ``LLM.generate`` in one call
   without a log (timed, after a 64-request warm-up), the same through an ``LLM`` with
   ``audit_log`` (its time kept as ``offline_with_log_seconds``), then ``detlora verify`` of
   that log (the warm-up's 64 lines too): its replay seconds (the engine built beforehand),
   ``per_s`` requests per second, ``vs_offline`` = that over offline requests per second.

    python -m benchmarks.suites.audit --out out/audit.json [--quick | --smoke]

Schema: {"meta", "serving": [{"audit_log", "concurrency", "tok_s", "trials_tok_s", "failed",
"lines_written", "lines_dropped"}], "verify": [{"log", "requests", "seconds", "per_s",
"vs_offline", "identical", "differing", "not_comparable", "offline_seconds",
"offline_with_log_seconds"}], "serving_ratio"}.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.suites import serving
from benchmarks.suites.serving import KEY, Plan


@dataclass(frozen=True)
class AuditPlan:
    serving: Plan = field(default_factory=Plan)
    concurrency: int = 64
    requests: int = 512
    trials: int = 2
    verify_requests: int = 10_000
    verify_output_len: int = 32

    @classmethod
    def quick(cls) -> AuditPlan:
        return cls(serving=Plan.quick(), requests=128, trials=1, verify_requests=1_000)

    @classmethod
    def smoke(cls) -> AuditPlan:
        return cls(serving=replace(Plan.smoke(), output_len=6), concurrency=4, requests=8,
                   trials=1, verify_requests=24, verify_output_len=4)


def _metric(url: str, name: str) -> float | None:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _stop(proc: subprocess.Popen) -> int | None:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def serving_row(root: Path, plan: AuditPlan, log_dir: Path | None, log: Any) -> dict[str, Any]:
    """One server (with the audit log in ``log_dir``, or without), its timed runs."""
    from benchmarks.harness.serving_load import LoadRequest, run_load_processes

    sp = plan.serving
    pool = serving.requests_pool(sp, sp.shape().vocab, plan.requests)
    extra = () if log_dir is None else ("--audit-log", str(log_dir))
    name = "with" if log_dir is not None else "without"
    url, proc = serving.start_server(root, sp, root / f"server-{name}.log", extra_args=extra)
    procs = serving.client_processes(plan.concurrency)
    try:
        warm = [LoadRequest("completion", {**b, "max_tokens": 8})
                for b in pool[:plan.concurrency]]
        run_load_processes(url, warm, concurrency=plan.concurrency, processes=procs,
                           api_key=KEY, deadline_s=300)
        runs, failed = [], 0
        for _ in range(plan.trials):
            results = run_load_processes(url, [LoadRequest("completion", b) for b in pool],
                                         concurrency=plan.concurrency, processes=procs,
                                         api_key=KEY, deadline_s=600)
            ok = [r for r in results if r.ok]
            failed += len(results) - len(ok)
            wall = max(r.end for r in results) - min(r.start for r in results)
            runs.append(round(sum(r.output_tokens for r in ok) / wall, 1))
        row = {"audit_log": log_dir is not None, "concurrency": plan.concurrency,
               "tok_s": statistics.median(runs), "trials_tok_s": runs, "failed": failed}
        if log_dir is not None:
            written = _metric(url, "detlora:audit_lines_written_total")
            row |= {"lines_written": written,
                    "lines_dropped": _metric(url, "detlora:audit_lines_dropped_total")}
    finally:
        status = _stop(proc)
    if log_dir is not None:  # the lines the last requests left queued, written at SIGTERM
        row["server_exit_status"] = status
    log(json.dumps(row))
    return row


def _verify_requests(plan: AuditPlan, vocab: int, loras: list[Any]) -> tuple[list, list, list]:
    from detlora import SamplingParams

    rng = random.Random(99)
    prompts, params, adapters = [], [], []
    for k in range(plan.verify_requests):
        prompts.append([rng.randrange(10, vocab - 10) for _ in range(plan.serving.prompt_len)])
        common = dict(max_tokens=plan.verify_output_len, ignore_eos=True, logprobs=0)
        params.append(SamplingParams(temperature=0.0, **common) if k % 2 == 0 else
                      SamplingParams(temperature=0.8, top_p=0.95, seed=k, **common))
        adapters.append(loras[k % len(loras)])
    return prompts, params, adapters


def verify_part(root: Path, plan: AuditPlan, log: Any) -> dict[str, Any]:
    """Offline without and with the log, then verify of that log (one process, one engine at
    a time)."""
    import torch

    from detlora import LLM, LoRARequest
    from detlora.audit.verify import VerifyOptions, verify

    sp = plan.serving
    loras = [LoRARequest(f"a{k}", k + 1, str(root / f"adapter{k}")) for k in range(2)]
    kwargs = {**serving.engine_args(sp), "enable_lora": True}
    if sp.tiny:
        kwargs["device"] = "cpu"
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    seconds = {}
    log_dir = root / "offline-log"
    for name, extra in (("offline", {}), ("offline_with_log", {"audit_log": str(log_dir)})):
        llm = LLM(str(root / "model"), **kwargs, **extra)
        prompts, params, adapters = _verify_requests(plan, llm.engine.spec.vocab_size, loras)
        warm = min(64, len(prompts))  # logged too: verify replays them with the rest
        llm.generate(prompts[:warm], params[:warm], adapters[:warm], use_tqdm=False)
        sync()
        t0 = time.perf_counter()
        llm.generate(prompts, params, adapters, use_tqdm=False)
        sync()
        seconds[name] = time.perf_counter() - t0
        llm.shutdown()
        del llm
        log(f"{name}: {plan.verify_requests} requests in {seconds[name]:.2f} s")
    report = verify([log_dir], VerifyOptions(progress=False, engine={"device": "cpu"}
                                             if sp.tiny else {}))
    s = report.summary()
    per_s = s["requests"] / report.seconds
    row = {"log": "offline", "requests": s["requests"], "seconds": round(report.seconds, 3),
           "per_s": round(per_s, 1),
           "vs_offline": round(per_s / (plan.verify_requests / seconds["offline"]), 3),
           "identical": s["identical"], "differing": s["differing"],
           "not_comparable": s["not_comparable"],
           "offline_seconds": round(seconds["offline"], 3),
           "offline_with_log_seconds": round(seconds["offline_with_log"], 3)}
    log(json.dumps(row))
    return row


def served_verify_row(log_dir: Path, plan: AuditPlan, log: Any) -> dict[str, Any]:
    from detlora.audit.verify import VerifyOptions, verify

    report = verify([log_dir], VerifyOptions(
        progress=False, engine={"device": "cpu"} if plan.serving.tiny else {}))
    s = report.summary()
    row = {"log": "served", "requests": s["requests"], "seconds": round(report.seconds, 3),
           "per_s": round(s["requests"] / report.seconds, 1) if report.seconds else None,
           "vs_offline": None, "identical": s["identical"], "differing": s["differing"],
           "not_comparable": s["not_comparable"]}
    log(json.dumps(row))
    if s["differing"] or s["not_comparable"]:
        log(report.render(limit=5))
    return row


def run(plan: AuditPlan, log: Any = print) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="detlora-audit-") as tmp:
        root = Path(tmp)
        serving.write_assets(root, plan.serving.shape())
        rows = [serving_row(root, plan, None, log),
                serving_row(root, plan, root / "served-log", log)]
        verify_rows = [served_verify_row(root / "served-log", plan, log),
                       verify_part(root, plan, log)]
    ratio = rows[1]["tok_s"] / rows[0]["tok_s"] if rows[0]["tok_s"] else None
    return {"serving": rows, "verify": verify_rows,
            "serving_ratio": None if ratio is None else round(ratio, 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/audit.json")
    p.add_argument("--quick", action="store_true", help="4 layers, fewer requests")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: the whole "
                   "script end to end (its figures mean nothing)")
    args = p.parse_args(argv)
    plan = AuditPlan.smoke() if args.smoke else AuditPlan.quick() if args.quick else AuditPlan()
    from benchmarks.harness import results_meta, write_results

    t0 = time.time()
    result = run(plan)
    command = "python -m benchmarks.suites.audit" + (
        " --smoke" if args.smoke else " --quick" if args.quick else "")
    write_results(args.out, {"meta": {**results_meta(command),
                                      "seconds": round(time.time() - t0, 1)}, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
