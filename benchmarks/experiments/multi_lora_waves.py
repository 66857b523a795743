"""Where does a working set of six times the slots spend its time?

``multi_lora.json`` (4e4304f): 512 requests over a working set of 6 x max_loras adapters
(Qwen3-0.6B shape, 32 prompt and 32 greedy output tokens, host cache warm) ran at 0.66x of
one adapter at max_loras 8 and 0.279x at 32: 192 steps either way (six waves of 32 steps),
but 10 ms a step at 32 slots against 5.3 at 8, and 181 swaps took 455 ms of host time. This
runs the suite's traffic engine on that working set (the suite's adapters, the first 6 x 32 of
its draws), at max_loras 8 and 32, and reports for the timed pass with the host cache warm:

* ``phases``: host seconds in the scheduler, adapter activation (swaps included), the model
  runner's launch, and reading a step's tokens (which waits for the GPU), per call;
* ``swap``: host and GPU time of one slot write (``SlotWriter.write``) per adapter rank;
* ``gpu``: the CUDA profiler over a third pass: kernel busy time against the wall, and the
  kernels by total time;
* ``host``: cProfile of a fourth pass (own time per function).

    PYTHONPATH=src python -m benchmarks.experiments.multi_lora_waves OUT.json [--tiny|--host]

``--host`` runs the full traffic plan on a tiny model on the CPU: the scheduler, adapter
activation and prefetch, input building and output reading are the GPU run's host code, so
their times there are what a change to them saves.
"""

from __future__ import annotations

import functools
import gc
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.suites.engine import write_model
from benchmarks.suites.multi_lora import (
    Plan,
    _distributions,
    _llm,
    _params,
    _prompts,
    write_adapters,
)
from benchmarks.suites.profile_engine import _PhaseClock, busy_us, device_events, host_profile

MAX_LORAS = (8, 32)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Any) -> tuple[float, float]:
    """Wall seconds of ``fn()`` (synchronised) and the milliseconds the cyclic garbage
    collector ran meanwhile."""
    pauses: list[float] = []
    started: list[float] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    _sync()
    gc.callbacks.append(watch)
    try:
        t = time.perf_counter()
        fn()
        _sync()
        wall = time.perf_counter() - t
    finally:
        gc.callbacks.remove(watch)
    return wall, round(sum(pauses) * 1e3, 2)


def _instrument(llm: Any, clock: _PhaseClock) -> None:
    eng = llm.engine
    eng.scheduler.schedule = clock.wrap("schedule", eng.scheduler.schedule)
    eng._activate_adapters = clock.wrap("activate_adapters", eng._activate_adapters)
    eng.lora_manager.slot_for = clock.wrap("slot_for", eng.lora_manager.slot_for)
    eng.lora_manager.prefetch = clock.wrap("prefetch", eng.lora_manager.prefetch)
    eng.runner.execute = clock.wrap("runner_execute", eng.runner.execute)
    eng.sampler.launch = clock.wrap("sampler_launch", eng.sampler.launch)
    eng._collect = clock.wrap("collect", eng._collect)


def _swap_times(llm: Any, adapters: list[Any], reps: int = 5) -> list[dict[str, Any]]:
    """One slot write per distinct (rank, targets) layout among ``adapters``: host time of
    ``SlotWriter.write`` and, on CUDA, the side stream's time for it."""
    mgr = llm.engine.lora_manager
    writer = mgr.writer
    writer.launched()  # the last step is enqueued
    resident = mgr.resident()[0]
    slot = mgr.slot_of(resident)
    mgr.remove(resident)  # a free slot to scribble on (zeroed again at the end)
    seen, rows = set(), []
    for req in adapters:
        image, _ = mgr.host.get(req)
        if image.layout in seen:
            mgr.host.release(image, None)
            continue
        seen.add(image.layout)
        host, gpu = [], []
        for _ in range(reps):
            _sync()
            t0 = time.perf_counter()
            copied = writer.write(slot, image)
            host.append((time.perf_counter() - t0) * 1e6)
            if writer.cuda:
                start = time.perf_counter()
                torch.cuda.synchronize()
                gpu.append((time.perf_counter() - start) * 1e6 + host[-1])
            writer.wait_ready([slot])
        mgr.host.release(image, copied)
        rows.append({"adapter": req.name, "bytes": image.nbytes, "pieces": len(image.pieces),
                     "host_us": round(sorted(host)[reps // 2], 1),
                     "host_plus_copy_us": round(sorted(gpu)[reps // 2], 1) if gpu else None})
    writer.clear(slot)
    return rows


def _gpu_profile(fn: Any) -> dict[str, Any]:
    wall_us, kernels = device_events(fn)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        entry = by_name[e["name"][:100]]
        entry[0] += e["dur"]
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {"wall_ms": round(wall_us / 1e3, 1), "busy_ms": round(busy_us(kernels) / 1e3, 1),
            "kernels": [{"kernel": k, "ms": round(v[0] / 1e3, 2), "launches": v[1]}
                        for k, v in top]}


def run(tiny: bool = False, log=print, host: bool = False) -> dict[str, Any]:
    """``tiny``: every code path at CPU size; ``host``: the full traffic plan on the tiny
    model on the CPU, where the engine's host phases are the same code as on the GPU."""
    plan = Plan.tiny() if tiny else Plan()
    if host:
        plan = replace(plan, traffic_model=Plan.tiny().traffic_model, device="cpu")
    plan = replace(plan, adapters=plan.working_set_factor * max(
        plan.traffic_max_loras if tiny else MAX_LORAS))
    name, shape = plan.traffic_model
    tmp = Path(tempfile.mkdtemp(prefix="multi_lora_waves_"))
    model = tmp / "model"
    write_model(model, shape)
    adapters = write_adapters(tmp / "adapters", shape, plan)
    prompts = _prompts(plan.requests, plan.prompt_len, shape.vocab, seed=1)
    params = _params(plan)
    levels = []
    for ml in (plan.traffic_max_loras if tiny else MAX_LORAS):
        llm = _llm(model, plan, max_loras=ml, num_kv_blocks=None if tiny or host else 1280)
        for r in adapters:
            llm.register_lora(r)
        _, picks = _distributions(plan, ml)["working_set_uniform"]
        loras = [adapters[k] for k in picks]
        single = [adapters[0]] * len(prompts)
        run_single = functools.partial(llm.generate, prompts, params, single, use_tqdm=False)
        again = functools.partial(llm.generate, prompts, params, loras, use_tqdm=False)
        run_single()  # compile, graphs
        singles = [_timed(run_single) for _ in range(3)]
        single_s = sorted(s for s, _ in singles)[1]
        llm.generate(prompts, params, loras, use_tqdm=False)  # pass 1: the host cache fills
        clock = _PhaseClock()
        _instrument(llm, clock)
        eng = llm.engine
        steps, swaps = eng.num_steps, eng.lora_stats.swaps
        wall, gc_ms = _timed(again)
        row = {"max_loras": ml, "adapters": len(set(picks)),
               "single_s": [round(s, 3) for s, _ in singles],
               "single_gc_ms": [g for _, g in singles],
               "working_set_s": round(wall, 3), "working_set_gc_ms": gc_ms,
               "vs_single": round(single_s / wall, 3),
               "steps": eng.num_steps - steps, "swaps": eng.lora_stats.swaps - swaps,
               "phases_s": {k: round(v, 4) for k, v in clock.seconds.items()},
               "phase_calls": dict(clock.calls)}
        gc.collect()
        gc.freeze()  # everything alive now out of the collector's scans (vLLM does it)
        frozen = [_timed(again) for _ in range(2)]
        frozen_single = _timed(run_single)
        gc.unfreeze()
        row["gc_frozen"] = {"working_set_s": [round(s, 3) for s, _ in frozen],
                            "working_set_gc_ms": [g for _, g in frozen],
                            "single_s": round(frozen_single[0], 3),
                            "single_gc_ms": frozen_single[1]}
        log(json.dumps(row))
        row["swap"] = _swap_times(llm, loras)
        log(json.dumps(row["swap"]))
        clock.reset()
        if llm.engine.runner.device.type == "cuda":
            row["gpu"] = _gpu_profile(again)
            log(json.dumps({k: v for k, v in row["gpu"].items() if k != "kernels"}))
            row["host"] = host_profile(again, top=40)
        levels.append(row)
        llm.engine.shutdown()
        del llm
    return {"model": name, "plan": {"requests": plan.requests, "prompt_len": plan.prompt_len,
                                    "output_len": plan.output_len}, "levels": levels}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = argv[0] if argv else "benchmarks/results/multi_lora_waves.json"
    result = run("--tiny" in argv, host="--host" in argv)
    write_results(out, {"meta": results_meta(
        "python -m benchmarks.experiments.multi_lora_waves " + " ".join(argv)), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
