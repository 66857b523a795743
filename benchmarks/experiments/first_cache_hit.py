"""Why the first batch that hits the prefix cache ran ~1.1 s slower than the next ones
(prefix_caching.json: 1.55 s against 0.41 s at batch_invariant).

Runs suites.prefix_cache's guardrail workload (Llama-3.2-3B shape, 256 requests sharing a
1024-token policy prompt, 64 tokens each of their own, 4-token verdicts) with the cache on, at
``batch_invariant``: a warm-up batch, then three batches with fresh suffixes. For each batch it
records the wall time, every engine step's wall time, and every
Triton compilation (kernel, seconds and the specialized signature, from Triton's JIT hooks)
that happened inside it, and those of the engine's start-up.

    PYTHONPATH=src python -m benchmarks.experiments.first_cache_hit OUT.json
"""

import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.compile_events import CompileRecorder
from benchmarks.suites.prefix_cache import PrefixPlan, make_llm, write_assets

EVENTS: list[dict] = []


def main(out_path: str, quick: bool = False) -> None:
    from detlora import SamplingParams
    plan = PrefixPlan.quick() if quick else PrefixPlan()
    CompileRecorder(EVENTS.append).install()
    batches = []
    with tempfile.TemporaryDirectory(prefix="detlora-first-hit-") as tmp:
        model_dir, lora, prompts = write_assets(Path(tmp), plan)
        t0 = time.perf_counter()
        cuda = torch.cuda.is_available()
        llm = make_llm(model_dir, plan, "batch_invariant", caching=True)
        init_s = time.perf_counter() - t0
        init_compiles = len(EVENTS)
        engine = llm.engine
        steps: list[dict] = []
        inner = engine.step
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def timed_step():
            sync()
            s0 = time.perf_counter()
            out = inner()
            sync()
            steps.append({"s": round(time.perf_counter() - s0, 4)})
            return out

        engine.step = timed_step
        params = SamplingParams(temperature=0.0,
                                max_tokens=plan.verdict_len, ignore_eos=True, logprobs=0)
        for index in range(4):
            steps.clear()
            first_event = len(EVENTS)
            sync()
            b0 = time.perf_counter()
            outs = llm.generate(prompts.batch(index), params, lora, use_tqdm=False)
            sync()
            row = {"batch": index, "seconds": round(time.perf_counter() - b0, 3),
                   "cached_tokens": sum(o.num_cached_tokens for o in outs),
                   "step_seconds": [s["s"] for s in steps],
                   "compiles": EVENTS[first_event:]}
            batches.append(row)
            print({k: row[k] for k in ("batch", "seconds", "cached_tokens")},
                  "steps", row["step_seconds"][:12], "compiles",
                  [(e["kernel"], e["seconds"]) for e in row["compiles"]], flush=True)
    meta = results_meta("python -m benchmarks.experiments.first_cache_hit OUT.json")
    write_results(out_path, {"meta": meta, "init_s": round(init_s, 2),
                                          "init_compiles": init_compiles,
                                          "init_events": EVENTS[:init_compiles],
                                          "batches": batches})


if __name__ == "__main__":
    main(sys.argv[1], quick="--quick" in sys.argv[2:])  # --quick: a 4-layer smoke test
