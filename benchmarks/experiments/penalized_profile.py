"""Where a penalized batch's extra time goes: batch 64, suites.engine's model (28 layers,
rank-16 adapter), batch_invariant, run-ahead on; 40 output tokens per request. For plain
requests and for the same requests with repetition 1.1, frequency 0.2 and presence 0.1: the
wall time per step, the GPU's busy time per step (union of kernel intervals over one
generate), the kernels that take the most time per step, and the host functions that take the
most of one generate (cProfile).

    PYTHONPATH=src python -m benchmarks.experiments.penalized_profile OUT.json
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.suites import engine as be
from benchmarks.suites import profile_engine as pe
from detlora import LoRARequest, SamplingParams

BATCH, TOKENS = 64, 40


def _trace_busy(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    busy = pe.busy_us(kernels)
    return {"wall_ms_per_step": round(1e3 * wall / TOKENS, 3),
            "gpu_busy_ms_per_step": round(busy / 1e3 / TOKENS, 3)}


def main(out_path: str) -> None:
    plan = be.BenchPlan()
    rows = []
    with tempfile.TemporaryDirectory(prefix="detlora-penalized-") as tmp:
        root = Path(tmp)
        be.write_model(root / "model", plan.shape)
        be.write_adapter(root / "adapter0", plan.shape, seed=10)
        lora = LoRARequest("a0", 1, str(root / "adapter0"))
        w = be.Workload(plan, [lora])
        llm = be.make_engine(root / "model", "batch_invariant", plan, max_num_seqs=BATCH)
        prompts = w.prompts[:BATCH]
        for label, extra in (("plain", {}), ("penalized", dict(
                repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1))):
            params = [SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0, **extra,
                                     **(dict(temperature=0.8, top_p=0.95, seed=k) if k % 2
                                        else dict(temperature=0.0)))
                      for k in range(BATCH)]

            def go(params=params) -> None:
                llm.generate(prompts, params, [lora] * BATCH, use_tqdm=False)

            row = {"case": label, **_trace_busy(go)}
            table = pe.kernel_table(go, steps=1, top=25)
            row["kernels_per_step"] = [
                {**k, "us_per_step": round(k["us_per_step"] / TOKENS, 2),
                 "launches_per_step": round(k["launches_per_step"] / TOKENS, 2)} for k in table]
            row["host_top"] = pe.host_profile(go, top=25)
            rows.append(row)
            print(label, row["wall_ms_per_step"], row["gpu_busy_ms_per_step"], flush=True)
            for k in row["kernels_per_step"][:12]:
                print("   ", k, flush=True)
            print("\n".join(row["host_top"][:16]), flush=True)
    meta = results_meta("python -m benchmarks.experiments.penalized_profile OUT.json")
    write_results(out_path, {"meta": meta, "batch": BATCH, "tokens": TOKENS, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1])
