"""Prefix caching on a guardrail workload: what the cache saves, and proof it keeps the bits.

Workload: R requests that share one policy prompt of S tokens, each followed by its own U
tokens (the text to classify), through one rank-16 adapter; a short greedy verdict of V tokens
with logprobs. Model: suites.engine's Llama-3.2-3B shape with random bf16 weights.

For each level, one engine with the cache off and one with it on (defaults aside) run the
same trials: a warm-up batch, then ``trials`` batches, each with fresh suffixes (so a trial
finds only the policy prompt cached, as a server would after its first request). Rows:
requests/s, prompt tok/s (prompt tokens over the batch time, cached ones included), the cached
prompt tokens, and the outputs compared with the cache-off engine's, token ids and logprobs
with ==.

    python -m benchmarks.suites.prefix_cache --out benchmarks/results/prefix_caching.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.suites.engine import ModelShape, free_gpu, same_output, write_adapter, write_model


@dataclass(frozen=True)
class PrefixPlan:
    shape: ModelShape = field(default_factory=ModelShape)
    requests: int = 256
    shared_len: int = 1024  # the policy prompt
    unique_len: int = 64  # each request's own text
    verdict_len: int = 4  # output tokens
    trials: int = 3
    modes: tuple[str, ...] = ("batch_invariant", "run_to_run")

    @classmethod
    def quick(cls) -> PrefixPlan:
        return cls(shape=replace(ModelShape(), layers=4), requests=32, shared_len=256,
                   unique_len=16, trials=2)


class Prompts:
    """The policy prompt and, per batch index, a fresh set of suffixes."""

    def __init__(self, plan: PrefixPlan) -> None:
        self.plan = plan
        g = torch.Generator().manual_seed(7)
        self.shared = torch.randint(10, plan.shape.vocab - 10, (plan.shared_len,),
                                    generator=g).tolist()

    def batch(self, index: int) -> list[list[int]]:
        p = self.plan
        g = torch.Generator().manual_seed(1000 + index)
        tails = torch.randint(10, p.shape.vocab - 10, (p.requests, p.unique_len), generator=g)
        return [self.shared + t for t in tails.tolist()]


def write_assets(root: Path, plan: PrefixPlan) -> tuple[Path, Any, Prompts]:
    """The workload's model and adapter under ``root``: (model dir, LoRARequest, prompts)."""
    from detlora import LoRARequest

    write_model(root / "model", plan.shape)
    write_adapter(root / "adapter", plan.shape, seed=10)
    return root / "model", LoRARequest("guard", 1, str(root / "adapter")), Prompts(plan)


def make_llm(model_dir: Path, plan: PrefixPlan, mode: str, caching: bool) -> Any:
    """The engine every run of the workload uses (one adapter slot, 8192-token steps)."""
    from detlora import LLM

    return LLM(str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=plan.shape.rank,
               determinism=mode, max_model_len=plan.shared_len + plan.unique_len + 16,
               max_num_seqs=256, max_num_batched_tokens=8192, enable_prefix_caching=caching)


def _run_engine(model_dir: Path, lora: Any, plan: PrefixPlan, mode: str, caching: bool,
                prompts: Prompts) -> tuple[dict[str, Any], list[list[Any]]]:
    from detlora import SamplingParams

    llm = make_llm(model_dir, plan, mode, caching)
    params = SamplingParams(temperature=0.0,
                            max_tokens=plan.verdict_len, ignore_eos=True, logprobs=0)
    outputs: list[list[Any]] = []
    times: list[float] = []
    cached: list[int] = []
    for index in range(plan.trials + 1):  # batch 0 is the warm-up
        batch = prompts.batch(index)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, lora, use_tqdm=False)
        torch.cuda.synchronize()
        if index:
            times.append(time.perf_counter() - t0)
            cached.append(sum(o.num_cached_tokens for o in outs))
        outputs.append(outs)
    t = statistics.median(times)
    prompt_tokens = plan.requests * (plan.shared_len + plan.unique_len)
    row = {"mode": mode, "prefix_caching": caching, "batch_s": t, "batch_s_all": times,
           "requests_per_s": plan.requests / t, "prompt_tok_per_s": prompt_tokens / t,
           "cached_prompt_tokens": statistics.median(cached), "prompt_tokens": prompt_tokens,
           "cuda_graphs": llm.engine.runner.uses_cuda_graphs,
           "fingerprint": outputs[0][0].fingerprint}
    del llm
    free_gpu()
    return row, outputs


def run(log: Callable[[str], None] = print, quick: bool = False) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise RuntimeError("the prefix caching benchmark needs a CUDA GPU")
    plan = PrefixPlan.quick() if quick else PrefixPlan()
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    determinism: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="detlora-bench-prefix-") as tmp:
        model_dir, lora, prompts = write_assets(Path(tmp), plan)
        for mode in plan.modes:
            by_caching = {}
            for caching in (False, True):
                row, outs = _run_engine(model_dir, lora, plan, mode, caching, prompts)
                runs.append(row)
                by_caching[caching] = outs
                log(f"{mode:16s} cache {'on ' if caching else 'off'}: "
                    f"{row['requests_per_s']:8.1f} req/s, {row['prompt_tok_per_s']:9.0f} "
                    f"prompt tok/s, {row['cached_prompt_tokens']:.0f} cached tokens")
            pairs = [(a, b) for x, y in zip(by_caching[False], by_caching[True], strict=True)
                     for a, b in zip(x, y, strict=True)]
            differing = sum(not same_output(a, b) for a, b in pairs)
            determinism.append({"mode": mode, "check": "cache_on_vs_off",
                                "comparisons": len(pairs), "differing": differing})
            log(f"{mode:16s} cache on vs off: {differing}/{len(pairs)} outputs differ")
    meta = {"model": {"shape": "Llama-3.2-3B", **asdict(plan.shape), "dtype": "bfloat16",
                      "weights": "random", "tied_embeddings": True},
            "plan": {k: v for k, v in asdict(plan).items() if k != "shape"}, "quick": quick,
            "seconds": round(time.perf_counter() - started, 1)}
    return {"meta": meta, "runs": runs, "determinism": determinism}


def speedups(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """requests/s with the cache over without, per mode."""
    rate = {(r["mode"], r["prefix_caching"]): r["requests_per_s"] for r in runs}
    return {mode: rate[mode, True] / rate[mode, False]
            for mode, caching in rate if caching and (mode, False) in rate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/prefix_caching.json")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    from benchmarks.harness import results_meta, write_results

    command = " ".join(["python -m benchmarks.suites.prefix_cache", *(argv or sys.argv[1:])])
    result = run(quick=args.quick)
    result["speedup"] = speedups(result["runs"])
    result["meta"] = {**results_meta(command), **result["meta"]}
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
