"""The engine's host (Python) time per short request, without the model's compute.

A guardrail or classifier sends thousands of ~15-token prompts that read one token (or one
decision). On the GPU a step of such prompts replays a step graph, so what each request costs
is Python: tokenizing, checks, the sequence, scheduling and pages, the step's inputs and their
staging, the sampler's host part, reading the token back, the output object. This measures
that on the CPU: ``LLM.generate`` of N one-token prompts in one call (``one_token``) and
``LLM.decide`` over N states (``decide``), with the engine's CUDA graphs replaced by stubs
(``benchmarks.harness.stub_model``): the decode and step graphs stage every input as on the
GPU but replay nothing; a step that no graph holds runs a stubbed forward (on the GPU it
launches hundreds of kernels, ~30 ms of host time for a 28-layer model: ``eager_steps``).

``core_one_token`` and ``core_decide`` are the same requests through a server's engine process
(``core_proc.EngineCore``, run here, fed by a thread that plays the front end and keeps
``--concurrency`` requests in flight): what that process spends a request, its pipe
messages, checks and per-step work over smaller steps included.

Models: ``tiny`` (the demo's random model and word-level tokenizer) or ``smollm2`` (the
embedded SmolLM2-135M-Instruct: its real tokenizer and chat template, its weights loaded but
never run). Times are per request: wall, this process's CPU time (``time.process_time``: the
tokenizers' worker threads too) and the calling thread's (``time.thread_time``: the engine's
own serial work, what one core must keep up with), the best and the median of ``--repeats``
calls; ``--profile`` adds a cProfile pass timed by the thread's CPU
clock (top functions by own and cumulative time; the statistics in ``OUT.WORKLOAD.prof``).

    PYTHONPATH=src python -m benchmarks.experiments.short_requests_host OUT.json \
        [--model tiny|smollm2] [--requests 2000] [--profile] \
        [--workloads one_token,decide,core_one_token,core_decide] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.stub_model import stub_model

TOP = 45
INSTRUCTIONS = "You moderate comments on a forum."
KV_BLOCKS = 2048
WORDS = ["the", "user", "asks", "a", "question", "and", "assistant", "answers", "it", "with",
         "care", "small", "models", "are", "quick", "to", "build", "run", "on", "laptop",
         "every", "token", "is", "chosen", "from", "logits"]


def prompts(n: int, seed: int = 1234) -> list[str]:
    """n distinct prompts of about 15 words."""
    rng = random.Random(seed)
    return [f"{k} " + " ".join(rng.choice(WORDS) for _ in range(13)) for k in range(n)]


def build_llm(model: str, root: Path, lora: bool) -> tuple[Any, Any]:
    from detlora import LLM, LoRARequest

    if model == "tiny":
        from detlora.entrypoints.demo import build_demo_assets

        model_dir, adapters = build_demo_assets(root / "tiny")
        rank = 8
    else:
        from detlora.entrypoints.demo import prepare_model

        demo = prepare_model(model, root, dtype=torch.float32)
        model_dir, adapters, rank = demo.model_dir, demo.adapters, demo.max_lora_rank
    # KV pages for two waves of 256 two-page prompts, as a GPU's cache holds (a CPU's default
    # would admit half a wave a step).
    llm = LLM(str(model_dir), device="cpu", determinism="batch_invariant", enable_lora=lora,
              max_lora_rank=rank, max_model_len=512, num_kv_blocks=KV_BLOCKS)
    req = LoRARequest("a", 1, str(adapters[0])) if lora else None
    return llm, req


def _call(llm: Any, workload: str, n: int, lora: Any) -> Any:
    """The timed call (its prompts made before: only the engine's work is timed). As the GPU
    suite (``small_models``): the chosen token's logprob, the decisions' instructions."""
    from detlora import SamplingParams

    if workload == "one_token":
        sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
        texts = prompts(n)
        return lambda: llm.generate(texts, sp, lora_request=lora, use_tqdm=False)
    question = {"toxic": {"type": "noul", "criteria": "Is this comment toxic?"}}
    states = prompts(n, seed=99)
    if _has_bulk_decide(llm):
        return lambda: llm.decide(states, question, instructions=INSTRUCTIONS,
                                  lora_request=lora, use_tqdm=False)
    return lambda: [llm.decide(s, question, instructions=INSTRUCTIONS, lora_request=lora)
                    for s in states]


def _core_call(llm: Any, workload: str, n: int, lora: Any, concurrency: int) -> Any:
    """A server's engine process (``core_proc.EngineCore``) in this process, its front end a
    thread that keeps ``concurrency`` requests in flight: the first ones in one batch
    message, then one batch per step message, as many as that step finished. Requests are
    what the front end sends (``AddRequest``, its own params object each, DELTA outputs of
    ids); only the core's thread is timed (``thread_cpu_us``)."""
    import copy
    import threading
    from multiprocessing import Pipe

    from detlora import SamplingParams
    from detlora.config import RequestOutputKind
    from detlora.engine.core_proc import AddRequest, EngineCore

    if workload == "core_one_token":
        base = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
        ids = llm.tokenizer.encode_many(prompts(n))
        items = [(ids[i], None) for i in range(n)]
    else:
        base = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        question = {"toxic": {"type": "noul", "criteria": "Is this comment toxic?"}}
        states = prompts(n, seed=99)
        reads = llm._plan_decisions(states, [question] * n, INSTRUCTIONS)
        items = [(rs[0].prompt_token_ids, rs[0].label_token_ids) for rs in reads]

    def add(i: int) -> tuple:
        params = copy.copy(base)  # async_llm's _engine_params: a copy per request
        object.__setattr__(params, "output_kind", RequestOutputKind.DELTA)
        object.__setattr__(params, "detokenize", False)
        ids, labels = items[i]
        return ("add", AddRequest(f"r{i}", list(ids), params, lora, 0, labels))

    def run() -> None:
        fe_in, core_out = Pipe(duplex=False)
        core_in, fe_out = Pipe(duplex=False)
        core = EngineCore(llm.engine, core_in, core_out)

        def front_end() -> None:
            sent = min(concurrency, n)
            fe_out.send(("batch", [add(i) for i in range(sent)]))
            done = 0
            while done < n:
                msg = fe_in.recv()
                if msg[0] != "step":
                    continue
                ended = sum(1 for d in msg[1] if d[3] is not None)
                done += ended
                more = min(ended, n - sent)
                if more:
                    fe_out.send(("batch", [add(i) for i in range(sent, sent + more)]))
                    sent += more
            fe_out.send(("shutdown", False))

        thread = threading.Thread(target=front_end)
        thread.start()
        core.run()
        thread.join()
        for conn in (fe_in, core_out, core_in, fe_out):
            conn.close()

    return run


def _has_bulk_decide(llm: Any) -> bool:
    import inspect

    return "use_tqdm" in inspect.signature(llm.decide).parameters


def _profile_rows(prof: cProfile.Profile, key: str) -> list[str]:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(TOP)
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()][-(TOP + 1):]


def measure(llm: Any, workload: str, n: int, lora: Any, repeats: int,
            profile: Path | None, concurrency: int = 64) -> dict[str, Any]:
    engine = llm.engine
    counter = stub_model(engine)
    run = (_core_call(llm, workload, n, lora, concurrency) if workload.startswith("core_")
           else _call(llm, workload, n, lora))
    run()  # warm-up: tokenizer caches, the adapter in its slot
    walls, cpus, threads = [], [], []
    steps0, eager0 = engine.num_steps, counter["eager_steps"]
    for _ in range(repeats):
        w0, c0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
        run()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        threads.append(time.thread_time() - t0)

    def us(values: list[float], pick: Any) -> float:
        return round(1e6 * pick(values) / n, 1)

    out: dict[str, Any] = {
        "requests": n, "wall_us_per_request": us(walls, min),
        "cpu_us_per_request": us(cpus, min),
        "cpu_us_per_request_median": us(cpus, statistics.median),
        "thread_cpu_us_per_request": us(threads, min),
        "thread_cpu_us_per_request_median": us(threads, statistics.median),
        "requests_per_s_host_bound": round(n / min(walls), 1),
        "steps_per_call": (engine.num_steps - steps0) / repeats,
        "eager_steps_per_call": (counter["eager_steps"] - eager0) / repeats,
        "bulk_decide": _has_bulk_decide(llm) if workload == "decide" else None,
    }
    if profile is not None:
        # This thread's CPU clock: a wall-clock profile on a busy host charges functions for
        # the time the process waited to be scheduled.
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        run()
        prof.disable()
        prof.dump_stats(profile)
        out["by_tottime"] = _profile_rows(prof, "tottime")
        out["by_cumtime"] = _profile_rows(prof, "cumtime")
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="one_token,decide",
                    help="of one_token, decide, core_one_token, core_decide")
    ap.add_argument("--concurrency", type=int, default=64,
                    help="requests in flight for the core_ workloads")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        llm, lora = build_llm(args.model, Path(tmp), not args.no_lora)
        for workload in args.workloads.split(","):
            prof = (args.out.with_name(f"{args.out.stem}.{workload}.prof") if args.profile
                    else None)
            rows[workload] = measure(llm, workload, args.requests, lora, args.repeats, prof,
                                     args.concurrency)
            print(workload, json.dumps({k: v for k, v in rows[workload].items()
                                        if not k.startswith("by_")}), flush=True)
        llm.shutdown()
    meta = {**results_meta("python -m benchmarks.experiments.short_requests_host "
                           + " ".join(argv)),
            "model": args.model, "requests": args.requests, "lora": not args.no_lora,
            "python": sys.version.split()[0]}
    write_results(args.out, {"meta": meta, "rows": rows}, history=False)


if __name__ == "__main__":
    main(sys.argv[1:])
