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

Models: ``tiny`` (the demo's random model and word-level tokenizer) or ``smollm2`` (the
embedded SmolLM2-135M-Instruct: its real tokenizer and chat template, its weights loaded but
never run). Times are per request: wall and this process's CPU time (``time.process_time``),
the best of ``--repeats`` calls; ``--profile`` adds a cProfile pass (top functions by own and
cumulative time).

    PYTHONPATH=src python -m benchmarks.experiments.short_requests_host OUT.json \
        [--model tiny|smollm2] [--requests 2000] [--workloads one_token,decide] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.stub_model import stub_model

TOP = 45
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
    llm = LLM(str(model_dir), device="cpu", determinism="batch_invariant", enable_lora=lora,
              max_lora_rank=rank, max_model_len=512)
    req = LoRARequest("a", 1, str(adapters[0])) if lora else None
    return llm, req


def _call(llm: Any, workload: str, n: int, lora: Any) -> Any:
    from detlora import SamplingParams

    if workload == "one_token":
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        return lambda: llm.generate(prompts(n), sp, lora_request=lora, use_tqdm=False)
    question = {"toxic": {"type": "noul", "criteria": "Is this comment toxic?"}}
    states = prompts(n, seed=99)
    if _has_bulk_decide(llm):
        return lambda: llm.decide(states, question, lora_request=lora, use_tqdm=False)
    return lambda: [llm.decide(s, question, lora_request=lora) for s in states]


def _has_bulk_decide(llm: Any) -> bool:
    import inspect

    return "use_tqdm" in inspect.signature(llm.decide).parameters


def _profile_rows(prof: cProfile.Profile, key: str) -> list[str]:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(TOP)
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()][-(TOP + 1):]


def measure(llm: Any, workload: str, n: int, lora: Any, repeats: int,
            profile: bool) -> dict[str, Any]:
    engine = llm.engine
    counter = stub_model(engine)
    run = _call(llm, workload, n, lora)
    run()  # warm-up: tokenizer caches, the adapter in its slot
    best_wall = best_cpu = float("inf")
    steps0, eager0 = engine.num_steps, counter["eager_steps"]
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        run()
        best_wall = min(best_wall, time.perf_counter() - w0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    out: dict[str, Any] = {
        "requests": n, "wall_us_per_request": round(1e6 * best_wall / n, 1),
        "cpu_us_per_request": round(1e6 * best_cpu / n, 1),
        "requests_per_s_host_bound": round(n / best_wall, 1),
        "steps_per_call": (engine.num_steps - steps0) / repeats,
        "eager_steps_per_call": (counter["eager_steps"] - eager0) / repeats,
        "bulk_decide": _has_bulk_decide(llm) if workload == "decide" else None,
    }
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        out["by_tottime"] = _profile_rows(prof, "tottime")
        out["by_cumtime"] = _profile_rows(prof, "cumtime")
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="one_token,decide")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        llm, lora = build_llm(args.model, Path(tmp), not args.no_lora)
        for workload in args.workloads.split(","):
            rows[workload] = measure(llm, workload, args.requests, lora, args.repeats,
                                     args.profile)
            print(workload, json.dumps({k: v for k, v in rows[workload].items()
                                        if not k.startswith("by_")}), flush=True)
        llm.shutdown()
    meta = {"model": args.model, "requests": args.requests, "lora": not args.no_lora,
            "python": sys.version.split()[0], "torch": torch.__version__}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
