"""Where an engine step's time goes, on the GPU: host phases, graph replay and kernels.

For each determinism level and batch size, on the model of ``suites.engine``:

* ``phases``: wall time per decode-heavy ``generate`` split into scheduling, step-input
  building, the model run (synchronised, so it holds the GPU time; ``stage``, the decode
  graph's input copies, is part of it), sampling, and the rest;
* ``replay_us``: one decode graph replay alone (CUDA events, median), the GPU floor of a step;
* ``kernels``: the profiler's kernel table of one replay (name, us per step, launches per step);
* ``timeline``: one replay's kernels on the streams CUPTI reports: per stream, busy time; on the
  stream with the most kernels, its span and its idle time split by the kernel after each gap.
  In a graph replay CUPTI puts each forked branch on a stream of its own and either branch may
  keep the launch stream, so a gap there can hold a kernel of the other branch (the side-stream
  shrink, or the GEMM beside it): read the per-stream busy times, and the gaps as upper bounds;
* ``prefill_forward_us``, ``prefill_kernels``: the first step (every prompt's prefill, eager)
  timed alone and its kernel table;
* ``sampler_us``: the sampler alone on random logits, with the requests of the engine's last
  sampling call (the batch's request mix); ``sampler_engine_call_us``: that call as it was;
  ``sampler_host_top``: its host time by function (cProfile);
* ``overlap`` (first, before any phase clock): one plain ``generate`` under the CUDA profiler:
  wall time against the union of kernel intervals (``gpu_busy_fraction`` well below 1 means the
  host, not the GPU, sets the pace), and the host's time by function in a second plain run.

    python -m benchmarks.suites.profile_engine --out out/profile_engine.json [--layers 28]
        [--adapters N]   (each batch's rows spread over N adapters in N slots)
        [--max-loras L]  (L slots, more than the adapters in use: what the slots cost)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.suites import engine as be


class _PhaseClock:
    """Wraps callables so that their wall time adds up under a phase name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable[..., Any], sync: bool = False) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def event_us(fn: Callable[[], Any], reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _profiled(fn: Callable[[], Any], steps: int) -> Any:
    """The CUDA profiler over ``steps`` synchronised calls of ``fn`` (after one warm call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
            torch.cuda.synchronize()
    return prof


def kernel_table(fn: Callable[[], Any], steps: int = 5, top: int = 40) -> list[dict[str, Any]]:
    prof = _profiled(fn, steps)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us <= 0:
            continue
        rows.append({"kernel": e.key[:120], "us_per_step": round(us / steps, 2),
                     "launches_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def stream_timeline(fn: Callable[[], Any], steps: int = 5) -> dict[str, Any]:
    """Stream timeline of ``steps`` calls of ``fn`` (a graph replay): per stream, kernel busy
    time; on the main stream (the one that runs the most kernels), the idle time between
    kernels, charged to the kernel that starts after the gap."""
    prof = _profiled(fn, steps)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {}
    by_stream: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in kernels:
        by_stream[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    main = max(by_stream, key=lambda s: len(by_stream[s]))
    seq = sorted(by_stream[main], key=lambda e: e["ts"])
    gaps: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    span = 0.0
    # Calls are synchronised one by one: a gap longer than 200 us is the host between calls.
    start = prev_end = seq[0]["ts"]
    for e in seq:
        gap = e["ts"] - prev_end
        if gap > 200:
            span += prev_end - start
            start = e["ts"]
        elif gap > 0:
            gaps[e["name"][:80]] += gap
            counts[e["name"][:80]] += 1
        prev_end = max(prev_end, e["ts"] + e["dur"])
    span += prev_end - start
    busy = {str(s): round(sum(e["dur"] for e in v) / steps, 1) for s, v in by_stream.items()}
    return {
        "main_stream": str(main),
        "main_span_us": round(span / steps, 1),
        "busy_us_by_stream": busy,
        "main_idle_us": round(sum(gaps.values()) / steps, 1),
        "main_idle_before": sorted(
            ({"kernel": k, "us_per_step": round(v / steps, 1), "gaps_per_step": counts[k] / steps}
             for k, v in gaps.items()), key=lambda r: -r["us_per_step"])[:15],
    }


def host_profile(fn: Callable[[], Any], top: int = 30) -> list[str]:
    """cProfile of one call (host time per function, sorted by own time)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-top:]


def busy_us(events: list[dict[str, Any]]) -> float:
    """Length of the union of the kernel intervals (us), over every stream."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def device_events(fn: Callable[[], Any]) -> tuple[float, list[dict[str, Any]]]:
    """One synchronised call of ``fn`` under the CUDA profiler: its wall time (us) and the
    trace's kernel, copy and memset events."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return wall_us, [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                     and "dur" in e]


def _overlap(llm: Any, w: Any, b: int) -> dict[str, Any]:
    """How much of a plain ``generate`` at batch ``b`` keeps the GPU busy, and the host's
    time by function (see the module doc)."""
    idx = list(range(b))
    w.generate(llm, idx)  # warm-up (graphs, caches)
    wall_us, kernels = device_events(lambda: w.generate(llm, idx))
    busy = busy_us(kernels)
    return {"batch": b, "wall_ms": round(wall_us / 1e3, 2), "gpu_busy_ms": round(busy / 1e3, 2),
            "gpu_busy_fraction": round(busy / wall_us, 3),
            "host_top": host_profile(lambda: w.generate(llm, idx), top=40)}


def _profile_mode(llm: Any, mode: str, w: Any, batches: tuple[int, ...],
                  log: Callable[[str], None]) -> list[dict[str, Any]]:
    eng = llm.engine
    le = sys.modules[type(eng).__module__]  # the engine's module, wherever it lives
    clock = _PhaseClock()
    last_step: dict[str, Any] = {}
    original_build = le.build_step_inputs

    def build(*args: Any, **kwargs: Any) -> Any:
        step = original_build(*args, **kwargs)
        last_step.setdefault("first", step)  # the prefill of every prompt
        last_step["step"] = step
        return step

    le.build_step_inputs = clock.wrap("build_inputs", build)
    eng.scheduler.schedule = clock.wrap("schedule", eng.scheduler.schedule)
    eng.runner.execute = clock.wrap("model", eng.runner.execute, sync=True)
    launch = eng.sampler.launch
    last_sample: dict[str, Any] = {}

    def sampler(logits: torch.Tensor, reqs: Any, greedy: Any = None) -> Any:
        return launch(logits, reqs, greedy=greedy).result()

    def sample_and_keep(logits: torch.Tensor, reqs: Any, greedy: Any = None,
                        fed: Any = None) -> Any:
        last_sample.update(logits=logits, reqs=reqs, greedy=greedy)
        pending = launch(logits, reqs, greedy=greedy, fed=fed)
        pending.result()  # the whole sampling inside this phase (the step ahead waits)
        return pending

    eng.sampler.launch = clock.wrap("sample", sample_and_keep, sync=True)
    graphs = eng.runner.graphs
    if graphs is not None:
        graphs.stage = clock.wrap("stage", graphs.stage)
    rows = []
    try:
        for b in batches:
            idx = list(range(b))
            w.generate(llm, idx)  # warm-up
            clock.reset()
            last_step.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            w.generate(llm, idx)
            total = time.perf_counter() - t0
            phases = {k: round(v * 1e3, 2) for k, v in clock.seconds.items()}
            # "stage" (the decode graph's input copies) is part of "model".
            phases["rest"] = round(total * 1e3 - sum(v for k, v in phases.items()
                                                     if k != "stage"), 2)
            row: dict[str, Any] = {"mode": mode, "batch": b, "total_ms": round(total * 1e3, 2),
                                   "steps": clock.calls["model"], "phases_ms": phases}
            graphs = eng.runner.graphs
            key = graphs.last_replayed if graphs is not None else None
            if key is not None and key[0] == graphs.bucket_for(b):  # the run's last decode
                g = graphs.graphs[key]
                row["replay_us"] = round(event_us(g.replay), 1)
                row["kernels"] = kernel_table(g.replay)
                row["timeline"] = stream_timeline(g.replay)
            first = last_step.get("first")
            if first is not None:  # the prefill step, eager (no graph), as generate runs it
                batch = eng.runner.forward_batch(first)
                with torch.inference_mode():
                    row["prefill_forward_us"] = round(
                        event_us(lambda batch=batch: eng.model(batch), reps=5), 1)
                    row["prefill_kernels"] = kernel_table(
                        lambda batch=batch: eng.model(batch), steps=2, top=25)
                log(f"  prefill forward {row['prefill_forward_us']} us")
                for k in row["prefill_kernels"][:15]:
                    log(f"  p {k['us_per_step']:9.1f} us  x{k['launches_per_step']:5.1f}  "
                        f"{k['kernel']}")
            step = last_step.get("step")
            if step is not None:
                batch = eng.runner.forward_batch(step)
                with torch.inference_mode():
                    row["eager_forward_us"] = round(
                        event_us(lambda batch=batch: eng.model(batch)), 1)
                    if b == batches[0]:
                        row["eager_host_top"] = host_profile(lambda batch=batch: eng.model(batch))
                        for line in row["eager_host_top"][:20]:
                            log(f"  h {line}")
            if last_sample:  # the engine's own last call: its requests, then its logits too
                logits = torch.randn(len(last_sample["reqs"]), eng.spec.vocab_size,
                                     device="cuda") * 3

                def sample(logits: torch.Tensor = logits,
                           reqs: list[Any] = last_sample["reqs"]) -> Any:
                    return sampler(logits, reqs)

                row["sampler_us"] = round(event_us(sample, reps=10), 1)
                row["sampler_engine_call_us"] = round(event_us(
                    lambda: sampler(last_sample["logits"], last_sample["reqs"],
                                    greedy=last_sample["greedy"]), reps=10), 1)
                row["sampler_kernels"] = kernel_table(sample, steps=3, top=15)
                row["sampler_host_top"] = host_profile(sample, top=25)
            rows.append(row)
            log(f"{mode} batch {b}: total {row['total_ms']:.1f} ms over {row['steps']} steps "
                f"{phases}; replay {row.get('replay_us')} us, eager "
                f"{row.get('eager_forward_us')} us, sampler {row.get('sampler_us')} us "
                f"(engine's call {row.get('sampler_engine_call_us')} us)")
            for k in row.get("kernels", [])[:25]:
                log(f"    {k['us_per_step']:9.1f} us  x{k['launches_per_step']:5.1f}  "
                    f"{k['kernel']}")
            tl = row.get("timeline") or {}
            if tl:
                log(f"  timeline: main span {tl['main_span_us']} us, idle "
                    f"{tl['main_idle_us']} us, busy by stream {tl['busy_us_by_stream']}")
                for k in tl["main_idle_before"][:8]:
                    log(f"  idle {k['us_per_step']:8.1f} us  x{k['gaps_per_step']:5.1f}  "
                        f"before {k['kernel']}")
            for k in row["sampler_kernels"][:8]:
                log(f"  s {k['us_per_step']:9.1f} us  x{k['launches_per_step']:5.1f}  "
                    f"{k['kernel']}")
    finally:
        le.build_step_inputs = original_build
        del eng.sampler.launch  # the method again
    return rows


def run(log: Callable[[str], None] = print, layers: int | None = None, tokens: int = 32,
        modes: tuple[str, ...] = ("fast", "batch_invariant"),
        batches: tuple[int, ...] = (1, 64), lora: bool = True,
        lora_reduction: str | None = None, overlap: bool = False,
        adapters: int = 1, max_loras: int | None = None,
        shape: str = "3b") -> dict[str, Any]:
    """``adapters`` > 1: that many adapters in as many slots, a batch's rows spread over them
    (row k on adapter k % adapters), to see which kernels grow with the adapters in a step.
    ``max_loras``: the engine's slots (default: the adapters', at least 2), to see which
    kernels grow with slots that no row uses. ``shape``: a name of ``engine.SHAPES``;
    ``layers`` None keeps its layer count."""
    from detlora import LoRARequest

    model_shape = be.SHAPES[shape]
    layers = layers or model_shape.layers
    plan = replace(be.BenchPlan(), shape=replace(model_shape, layers=layers),
                   output_len=tokens, throughput_batches=batches)
    out: dict[str, Any] = {"plan": {"shape": shape, "layers": layers, "output_tokens": tokens,
                                    "lora": lora, "lora_reduction": lora_reduction,
                                    "adapters": adapters, "max_loras": max_loras},
                           "rows": []}
    with tempfile.TemporaryDirectory(prefix="detlora-profile-") as tmp:
        root = Path(tmp)
        be.write_model(root / "model", plan.shape)
        count = max(2, adapters)
        if max_loras is not None and max_loras < adapters:
            raise ValueError(f"--max-loras {max_loras} is below --adapters {adapters}")
        for k in range(count):
            be.write_adapter(root / f"adapter{k}", plan.shape, seed=10 + k)
        loras = [LoRARequest(f"a{k}", k + 1, str(root / f"adapter{k}")) for k in range(count)]
        w = be.Workload(plan, loras[:max(1, adapters)] if lora else [])
        w.spread = adapters > 1
        for mode in modes:
            llm = be.make_engine(root / "model", mode, plan, enable_lora=lora,
                                 lora_reduction=lora_reduction, max_loras=max_loras or count)
            label = mode if lora else f"{mode}-nolora"
            label += f"-{lora_reduction}" if lora_reduction else ""
            label += f"-{adapters}adapters" if adapters > 1 else ""
            label += f"-{max_loras}slots" if max_loras else ""
            if overlap:
                for b in batches:
                    ov = {"mode": label, **_overlap(llm, w, b)}
                    out.setdefault("overlap", []).append(ov)
                    log(f"{label} batch {b}: wall {ov['wall_ms']} ms, GPU busy "
                        f"{ov['gpu_busy_ms']} ms ({ov['gpu_busy_fraction']})")
                    for line in ov["host_top"][:25]:
                        log(f"  o {line}")
            out["rows"] += _profile_mode(llm, label, w, batches, log)
            del llm
            be.free_gpu()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="profile engine steps on the GPU")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="3b", choices=sorted(be.SHAPES),
                        help="the model shape (random weights)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers (default: the shape's)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--modes", default="fast,batch_invariant")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--lora-reduction", default=None,
                        help="override every level's LoRA reduction (e.g. in_gemm)")
    parser.add_argument("--no-lora", action="store_true",
                        help="the base model alone (no LoRA slots, no adapters)")
    parser.add_argument("--adapters", type=int, default=1,
                        help="spread each batch's rows over this many adapters (one slot each)")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="slots in the engine (default: the adapters', at least 2)")
    parser.add_argument("--overlap", action="store_true",
                        help="also time a plain generate against its GPU busy time")
    args = parser.parse_args(argv)
    body = run(layers=args.layers, tokens=args.tokens, modes=tuple(args.modes.split(",")),
               batches=tuple(int(b) for b in args.batches.split(",")), lora=not args.no_lora,
               lora_reduction=args.lora_reduction, overlap=args.overlap,
               adapters=args.adapters, max_loras=args.max_loras, shape=args.shape)
    from benchmarks.harness import results_meta, write_results

    command = " ".join(["python -m benchmarks.suites.profile_engine", *(argv or sys.argv[1:])])
    write_results(args.out, {"meta": results_meta(command), **body})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
