"""What the server's front end spends per streamed token and per request, and where.

Starts ``detlora serve`` on the serving suite's tiny model (a CPU engine is fine: only the
front end's CPU is read), streams ``--requests`` completions of ``--output-tokens`` tokens
(48 by default) from ``--concurrency`` clients twice, and records the front end's CPU
microseconds per streamed token and per request (from /proc) for each pass. With few output
tokens (1 or 2) the per-request part (HTTP, validation, prompt, submission, the response's
start) dominates. The bodies are the serving suite's (adapters as model names, logprobs, half
of them seeded sampling); ``--route chat`` sends the same requests to /v1/chat/completions
(one user message of the prompt's words); ``--route decisions`` sends /v1/decisions requests
instead (one noul question about a state of 60 words, adapter a0, as the serving suite's),
whose front-end work is the question's chat template and tokenizing the state. With
``--profile FILE`` the front end runs under cProfile, timed by its main thread's CPU clock
(``benchmarks.harness.cpu_profile``), and FILE gets its statistics (``python -m pstats FILE``).

    PYTHONPATH=src python -m benchmarks.experiments.frontend_token_cost OUT.json \
        [--concurrency 64] [--requests 256] [--output-tokens 48] \
        [--route completion|chat|decisions] \
        [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.serving_load import LoadRequest, run_load_processes
from benchmarks.suites import serving

OUTPUT_TOKENS = 48


def _profiled_server(profile: str) -> None:
    """Run the server's process under cProfile (the suite starts it with Popen)."""
    real = subprocess.Popen

    def popen(cmd: list[str], *args: Any, **kwargs: Any) -> subprocess.Popen:
        if "serve" in cmd:  # by the event loop's CPU time, not the wall
            cmd = [cmd[0], "-m", "benchmarks.harness.cpu_profile", profile, *cmd[1:]]
        return real(cmd, *args, **kwargs)

    serving.subprocess.Popen = popen  # type: ignore[attr-defined]


def _chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A completion body of the pool as a chat body: the prompt's ids as one user message of
    the tiny tokenizer's words (``w<id>``)."""
    chat = {k: v for k, v in body.items() if k not in ("prompt", "logprobs")}
    chat["messages"] = [{"role": "user", "content": " ".join(f"w{t}" for t in body["prompt"])}]
    chat["logprobs"] = True
    return chat


async def _chat_load(url: str, bodies: list[dict[str, Any]], concurrency: int) -> int:
    """Stream ``bodies`` to /v1/chat/completions from ``concurrency`` clients; the answers
    that ended with ``[DONE]``."""
    todo = list(reversed(bodies))
    ok = 0
    headers = {"Authorization": f"Bearer {serving.KEY}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=600, limits=limits,
                                 trust_env=False) as client:

        async def worker() -> None:
            nonlocal ok
            while todo:
                body = {**todo.pop(), "stream": True}
                async with client.stream("POST", url + "/v1/chat/completions",
                                         json=body) as r:
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            ok += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def _chat_slice(url: str, bodies: list[dict[str, Any]], concurrency: int,
                start_at: float) -> tuple[int, float]:
    """One client process: its answers ended well, and the share of a core it kept busy."""
    time.sleep(max(0.0, start_at - time.time()))
    cpu, wall = time.process_time(), time.perf_counter()
    ok = asyncio.run(_chat_load(url, bodies, concurrency))
    return ok, (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)


def _run_chat(url: str, bodies: list[dict[str, Any]], concurrency: int,
              client_cpu: list[float]) -> int:
    """``_chat_slice`` in two processes that start together; the answers that ended well."""
    half = -(-len(bodies) // 2)
    with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
        start_at = time.time() + 3.0
        futures = [pool.submit(_chat_slice, url, part, max(1, concurrency // 2), start_at)
                   for part in (bodies[:half], bodies[half:]) if part]
        ok = 0
        for f in futures:
            n, cpu = f.result()
            ok += n
            client_cpu.append(cpu)
    return ok


def decision_bodies(vocab: int, n: int, words: int = 60) -> list[dict[str, Any]]:
    """n /v1/decisions bodies: one noul question about a distinct state of ``words`` words
    of the tiny tokenizer (``w<id>``), adapter a0."""
    import random

    rng = random.Random(7)
    return [{"model": "a0", "state": " ".join(f"w{rng.randrange(20, vocab - 1)}"
                                              for _ in range(words)),
             "questions": {"toxic": {"type": "noul", "criteria": "Is this comment toxic?"}}}
            for _ in range(n)]


def run(concurrency: int, requests: int, profile: str | None, output_tokens: int = OUTPUT_TOKENS,
        route: str = "completion", stub: bool = False, clients: int = 2) -> dict[str, Any]:
    plan = replace(serving.Plan.smoke(), prompt_len=16, output_len=output_tokens)
    shape = plan.shape()
    if profile:
        _profiled_server(profile)
    rows = []
    with tempfile.TemporaryDirectory(prefix="detlora-frontend-") as tmp:
        root = Path(tmp)
        serving.write_assets(root, shape)
        pool = serving.requests_pool(plan, shape.vocab, requests)
        url, proc = serving.start_server(root, plan, root / "server.log", stub_model=stub)
        try:
            warm = [LoadRequest("completion", {**b, "max_tokens": 4}) for b in pool[:concurrency]]
            run_load_processes(url, warm, concurrency=concurrency, processes=clients,
                               api_key=serving.KEY)
            for rep in range(2):
                before, t0 = serving.server_cpu(proc), time.perf_counter()
                client_cpu: list[float] = []
                if route == "chat":
                    ok = _run_chat(url, [_chat_body(b) for b in pool], concurrency, client_cpu)
                elif route == "decisions":
                    res = run_load_processes(
                        url, [LoadRequest("decision", b)
                              for b in decision_bodies(shape.vocab, requests)],
                        concurrency=concurrency, processes=clients, api_key=serving.KEY,
                        deadline_s=600, client_cpu=client_cpu)
                    ok = sum(r.ok for r in res)
                else:
                    res = run_load_processes(url, [LoadRequest("completion", b) for b in pool],
                                             concurrency=concurrency, processes=clients,
                                             api_key=serving.KEY, deadline_s=600,
                                             client_cpu=client_cpu)
                    ok = sum(r.ok for r in res)
                wall, after = time.perf_counter() - t0, serving.server_cpu(proc)
                tokens = ok * (1 if route == "decisions" else output_tokens)
                frontend = after["frontend"] - before["frontend"]
                rows.append({
                    "pass": rep, "ok": ok, "wall_s": round(wall, 2),
                    "output_tok_per_s": round(tokens / wall),
                    "requests_per_s": round(ok / wall, 1),
                    "frontend_us_per_request": round(1e6 * frontend / max(ok, 1), 1),
                    "frontend_us_per_token": round(1e6 * frontend / max(tokens, 1), 1),
                    "engine_us_per_token": round(
                        1e6 * (after["engine"] - before["engine"]) / max(tokens, 1), 1),
                    "engine_us_per_request": round(
                        1e6 * (after["engine"] - before["engine"]) / max(ok, 1), 1),
                    "client_us_per_token": round(1e6 * sum(client_cpu) * wall / max(tokens, 1),
                                                 1)})
                print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    return {"concurrency": concurrency, "requests": requests, "output_tokens": output_tokens,
            "route": route, "stub_model": stub,
            "uvloop": importlib.util.find_spec("uvloop") is not None,
            "httptools": importlib.util.find_spec("httptools") is not None, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    p.add_argument("--route", choices=("completion", "chat", "decisions"), default="completion")
    p.add_argument("--profile", default=None, metavar="FILE")
    p.add_argument("--stub-model", action="store_true",
                   help="the engine's model computes nothing (benchmarks.harness.stub_model): "
                        "the server at the speed of its host code")
    p.add_argument("--clients", type=int, default=2, help="client processes (default: 2)")
    args = p.parse_args(argv)
    result = run(args.concurrency, args.requests, args.profile, args.output_tokens, args.route,
                 args.stub_model, args.clients)
    command = " ".join(["python -m benchmarks.experiments.frontend_token_cost", *sys.argv[1:]])
    write_results(args.out, {"meta": results_meta(command), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
