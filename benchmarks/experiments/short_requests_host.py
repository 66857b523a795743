"""The engine's host (Python) time per short request, without the model's compute.

A guardrail or classifier sends thousands of ~15-token prompts that read one token (or one
decision). On the GPU a step of such prompts replays a step graph, so what each request costs
is Python: tokenizing, checks, the sequence, scheduling and pages, the step's inputs and their
staging, the sampler's host part, reading the token back, the output object. This measures
that on the CPU: ``LLM.generate`` of N one-token prompts in one call (``one_token``) and
``LLM.decide`` over N states (``decide``), with the engine's CUDA graphs replaced by stubs
(``engine_host_step``'s idea): the decode and step graphs stage every input as on the GPU
(pinned-buffer twins, here on the CPU) but their replay does nothing and their outputs are
fixed logits with their greedy head; a step that no graph holds runs the model's stubbed
forward (fixed logits: on the GPU such a step launches hundreds of kernels, ~30 ms of host
time for a 28-layer model, counted here as ``eager_steps``). The sampler's device work still
runs (torch on the CPU, small tensors). The engine runs ahead as with CUDA graphs.

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

TOP = 45
WORDS = ["the", "user", "asks", "a", "question", "and", "assistant", "answers", "it", "with",
         "care", "small", "models", "are", "quick", "to", "build", "run", "on", "laptop",
         "every", "token", "is", "chosen", "from", "logits"]


class _NoReplay:
    """A captured graph that computes nothing: its outputs stay the fixed ones."""

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        pass


def stub_graphs(engine: Any) -> dict[str, int]:
    """Give ``engine``'s runner decode and step graphs whose replay does nothing, and a model
    whose eager forward returns fixed logits (counted); the engine runs ahead as with CUDA
    graphs. Returns the counter of eager steps (``{"eager_steps": n}``, updated in place)."""
    from detlora.engine.runner.step_graphs import StepGraphs

    runner, spec, c = engine.runner, engine.spec, engine.config
    graphs, step_graphs = runner.build_graphs(c.max_num_seqs, c.max_num_batched_tokens)
    g = torch.Generator().manual_seed(0)
    rows = max(graphs.buckets[-1], c.max_num_batched_tokens)
    logits = torch.randn(rows, spec.vocab_size, generator=g).to(engine.dtype)
    head = engine.sampler.greedy_head(logits)
    for key in graphs.graph_keys():
        graphs.graphs[key] = _NoReplay()
        graphs.outputs[key] = (logits[:key[0]], head[:key[0]])
    runner.graphs = graphs
    if isinstance(step_graphs, StepGraphs):
        for tb, sb in step_graphs.buckets:
            step_graphs.graphs[(tb, sb)] = _NoReplay()
            step_graphs.outputs[(tb, sb)] = (logits[:sb], head[:sb])
        runner.step_graphs = step_graphs
    counter = {"eager_steps": 0}
    model = engine.model
    hidden = torch.zeros(rows, spec.hidden_size, dtype=engine.dtype)

    def forward(batch: Any, upcast: bool = True) -> torch.Tensor:
        counter["eager_steps"] += 1
        return logits[: batch.logits_indices.numel()]

    def hidden_states(batch: Any) -> torch.Tensor:
        counter["eager_steps"] += 1
        return hidden[: batch.input_ids.numel()]

    model.forward = forward  # an instance attribute: nn.Module.__call__ finds it
    model.hidden_states = hidden_states
    engine.run_ahead = True
    return counter


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
    counter = stub_graphs(engine)
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
