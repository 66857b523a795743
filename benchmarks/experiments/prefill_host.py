"""Where the host time of an eager prefill forward goes (suites.engine's model, 28 layers).

For each level: one engine, a warm-up generate, then the prefill step of one 100-token prompt
(and of 16) run eagerly as ``generate`` runs it: host time to enqueue the forward (no sync),
GPU time (CUDA events), and a cProfile of one forward, by own time and by cumulative time.

    PYTHONPATH=src python -m benchmarks.experiments.prefill_host OUT.json [levels]
"""

import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.suites import engine as be
from detlora import LoRARequest


def _stats(prof: cProfile.Profile, key: str, top: int) -> list[str]:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()][-top:]


def profile_prefill(llm, batch) -> dict:
    eng = llm.engine
    with torch.inference_mode():
        for _ in range(2):
            eng.model(batch)
        torch.cuda.synchronize()
        host, total = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            eng.model(batch)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        eng.model(batch)
        end.record()
        end.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        eng.model(batch)
        torch.cuda.synchronize()
        prof.disable()
    return {"host_enqueue_ms": round(1e3 * statistics.median(host), 2),
            "wall_ms": round(1e3 * statistics.median(total), 2),
            "events_ms": round(start.elapsed_time(end), 2),
            "by_tottime": _stats(prof, "tottime", 45), "by_cumtime": _stats(prof, "cumtime", 45)}


def main(out_path: str, levels: list[str]) -> None:
    plan = replace(be.BenchPlan(), output_len=4, throughput_batches=(1, 16))
    rows = []
    with tempfile.TemporaryDirectory(prefix="detlora-prefill-") as tmp:
        root = Path(tmp)
        be.write_model(root / "model", plan.shape)
        be.write_adapter(root / "adapter0", plan.shape, seed=10)
        w = be.Workload(plan, [LoRARequest("a0", 1, str(root / "adapter0"))])
        for level in levels:
            llm = be.make_engine(root / "model", level, plan)
            le = sys.modules[type(llm.engine).__module__]  # the engine's module
            for b in (1, 16):
                first = {}
                original = le.build_step_inputs

                def build(*args, original=original, first=first, **kwargs):
                    step = original(*args, **kwargs)
                    first.setdefault("step", step)
                    return step

                le.build_step_inputs = build
                try:
                    w.generate(llm, list(range(b)))
                finally:
                    le.build_step_inputs = original
                batch = llm.engine.runner.forward_batch(first["step"])
                row = {"level": level, "batch": b, **profile_prefill(llm, batch)}
                rows.append(row)
                print({k: v for k, v in row.items() if not k.startswith("by_")}, flush=True)
                for line in row["by_tottime"][:30]:
                    print("  t", line)
                for line in row["by_cumtime"][:30]:
                    print("  c", line)
            del llm
            be.free_gpu()
    meta = results_meta("python -m benchmarks.experiments.prefill_host OUT.json "
                        + ",".join(levels))
    write_results(out_path, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2
         else ["batch_invariant", "run_to_run"])
