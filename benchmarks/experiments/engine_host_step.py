"""The engine's host (Python) time per decode step, without the model's compute.

A decode step on the GPU replays a CUDA graph: the forward costs the host one replay call,
and what is left is Python (scheduling, step inputs and their staging, adapter bookkeeping,
the sampler's host part and its launches, reading the tokens back, outputs). This measures
that Python on the CPU: the tiny demo model (``detlora.entrypoints.demo``), 64 requests like
the serving suite's (100-token random prompts, two adapters alternating, half greedy and
half seeded top-p sampling, the chosen tokens' logprobs, EOS ignored), and the engine's
decode graphs replaced by stubs: ``DecodeGraphs`` stages every step's inputs as on the GPU
(pinned-buffer twins, here on the CPU) but its replay does nothing, and its outputs are
fixed logits and their greedy head. The engine runs one step ahead, as with CUDA graphs.
The sampler's device work for the sampled rows still runs (torch on the CPU, small
tensors): it stands in for its kernel launches on the GPU.

Two paths, each timed per step after the prefill and a warm-up, by the wall clock and by
this thread's CPU clock (``time.thread_time``: what the step cost the host, steadier than
the wall on a machine shared with other jobs):

* ``offline``: ``LLMEngine.step()`` with ``FINAL_ONLY`` requests, as ``LLM.generate`` runs it;
  also the CPU time without the sampler's device ops (``cpu_without_sampler_device_ops``);
* ``step_delta``: the same with ``DELTA`` requests: a ``RequestOutput`` per request and step,
  as a caller streaming from ``LLMEngine.step()`` gets them;
* ``serving``: the serving child's loop (``EngineCore.run`` in this process), its front end
  a second process that sends the requests and drains the step messages; a step's host time
  is the interval between two step messages' sending (``loop``, ``loop_cpu``: the loop's
  whole iteration: pipe poll, step, deltas, stats, pickling and sending).

``--breakdown`` adds an offline pass timing a few engine functions (CPU time, inclusive);
``--profile`` a cProfile pass of each path (own and cumulative time, top functions). Times
are medians over the timed steps, in microseconds.

    PYTHONPATH=src python -m benchmarks.experiments.engine_host_step OUT.json \
        [--seqs 64] [--steps 150] [--paths offline,step_delta,serving] [--breakdown] \
        [--profile] [--no-lora] [--max-loras 2]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import multiprocessing as mp
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PROMPT_LEN = 100
MAX_TOKENS = 400  # the tiny model's 512 positions, less the prompt
WARMUP_STEPS = 20
TOP = 40  # profile rows kept


class DeviceOpTimer:
    """CPU seconds spent in the sampler's device ops (the sampled rows' filters and Gumbel-max,
    the chosen logprobs and ranks): torch on the CPU here, kernel launches on the GPU."""

    def __init__(self, engine: Any) -> None:
        from detlora.engine.sample import sampler as sampler_module
        from detlora.ops import sampling

        self.seconds = 0.0
        self._wrap(sampler_module, "filter_logits")
        self._wrap(sampling, "gumbel_argmax_ref")
        self._wrap(sampling, "gumbel_argmax")
        s = engine.sampler
        for name in ("_chosen", "_rank"):
            setattr(s, name, self._timed(getattr(s, name)))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - t0

        return timed

    def _wrap(self, module: Any, name: str) -> None:
        setattr(module, name, self._timed(getattr(module, name)))

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


# (owner, attribute) pairs timed by ``--breakdown``, inclusive of what they call.
def _breakdown_targets(engine: Any) -> dict[str, tuple[Any, str]]:
    from detlora.engine import llm_engine

    targets = {
        "schedule": (engine.scheduler, "schedule"),
        "build_step_inputs": (llm_engine, "build_step_inputs"),
        "runner.execute": (engine.runner, "execute"),
        "sampler.launch": (engine.sampler, "launch"),
        "_sample_request": (engine, "_sample_request"),
        "_collect": (engine, "_collect"),
        "block_manager.register": (engine.block_manager, "register"),
    }
    if engine.lora_manager is not None:
        targets["_activate_adapters"] = (engine, "_activate_adapters")
        targets["_prefetch_adapters"] = (engine, "_prefetch_adapters")
    return targets


class Breakdown:
    """CPU seconds per step inside a few engine functions (inclusive), from thread-clock
    wrappers set on the instances (or modules) that own them."""

    def __init__(self, engine: Any) -> None:
        self.seconds: dict[str, float] = {}
        self.per_step: dict[str, list[float]] = {}
        for name, (owner, attr) in _breakdown_targets(engine).items():
            self.seconds[name] = 0.0
            self.per_step[name] = []
            setattr(owner, attr, self._timed(name, getattr(owner, attr)))

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - t0

        return timed

    def end_step(self) -> None:
        for name, s in self.seconds.items():
            self.per_step[name].append(s)
            self.seconds[name] = 0.0

    def summary(self) -> dict[str, float]:
        return {name: round(1e6 * statistics.median(v), 1) for name, v in self.per_step.items()}


class _NoReplay:
    """A captured graph that computes nothing: its outputs stay the fixed ones."""

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        pass


def stub_decode_graphs(engine: Any, seed: int = 0) -> None:
    """Give ``engine``'s runner decode graphs whose replay does nothing (see the module
    docstring), and let the engine run ahead as it does with CUDA graphs."""
    runner = engine.runner
    graphs, _ = runner.build_graphs(engine.config.max_num_seqs, 0)
    n = graphs.buckets[-1]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, engine.spec.vocab_size, generator=g).to(engine.dtype)
    head = engine.sampler.greedy_head(logits)
    for key in graphs.graph_keys():
        graphs.graphs[key] = _NoReplay()
        graphs.outputs[key] = (logits[:key[0]], head[:key[0]])
    runner.graphs = graphs
    engine.run_ahead = True


def build_engine(model_dir: Path, seqs: int, lora: bool, max_loras: int = 2) -> Any:
    from detlora.engine.llm_engine import LLMEngine
    from detlora.engine_args import EngineArgs

    args = EngineArgs(model=str(model_dir), device="cpu", determinism="batch_invariant",
                      max_num_seqs=seqs, max_model_len=512, enable_lora=lora, max_loras=max_loras,
                      max_lora_rank=8)
    engine = LLMEngine(args)
    stub_decode_graphs(engine)
    return engine


def requests(engine: Any, n: int, max_tokens: int, adapters: list[Path] | None,
             kind: Any) -> list[tuple[list[int], Any, Any]]:
    """The serving suite's mix: request k on adapter k % 2, greedy when k is even, else
    seeded top-p sampling; the chosen tokens' logprobs; EOS ignored."""
    from detlora import LoRARequest, SamplingParams

    vocab = engine.spec.vocab_size
    rng = random.Random(1234)
    loras = ([LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(adapters)]
             if adapters else None)
    out = []
    for k in range(n):
        prompt = [rng.randrange(10, vocab - 10) for _ in range(PROMPT_LEN)]
        common = dict(max_tokens=max_tokens, ignore_eos=True, logprobs=0, output_kind=kind,
                      detokenize=False)
        params = (SamplingParams(**common, temperature=0.0) if k % 2 == 0 else
                  SamplingParams(**common, temperature=0.8, top_p=0.95, seed=k))
        out.append((prompt, params, loras[k % 2] if loras else None))
    return out


def _summary(seconds: list[float]) -> dict[str, float]:
    us = sorted(1e6 * s for s in seconds)
    return {"steps": len(us), "median_us": round(statistics.median(us), 1),
            "p10_us": round(us[len(us) // 10], 1), "p90_us": round(us[9 * len(us) // 10], 1),
            "mean_us": round(statistics.fmean(us), 1)}


def _profile_rows(prof: cProfile.Profile, key: str, steps: int) -> list[str]:
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats(key).print_stats(TOP)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    head = f"per step: divide by {steps} (profiled steps)"
    return [head, *lines[-(TOP + 1):]]


# ---- offline: LLMEngine.step() ----

def run_offline(model_dir: Path, adapters: list[Path] | None, seqs: int, steps: int,
                profile: bool, breakdown: bool = False, delta: bool = False,
                max_loras: int = 2) -> dict[str, Any]:
    """``LLMEngine.step()``: FINAL_ONLY requests (``LLM.generate``), or with ``delta`` DELTA
    ones (an output per request and step, as a caller streaming from the engine gets)."""
    from detlora.config import RequestOutputKind

    engine = build_engine(model_dir, seqs, adapters is not None, max_loras)
    passes = 2 if profile or breakdown else 1
    if passes * steps + WARMUP_STEPS + 4 > MAX_TOKENS:
        raise ValueError(f"--steps {steps}: every sequence must decode in every step")
    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    reqs = requests(engine, seqs, MAX_TOKENS, adapters, kind)
    for prompt, params, lora in reqs:
        engine.add_request(prompt, params, lora=lora)
    while engine.scheduler.waiting or engine.num_steps_ahead == 0:
        engine.step()  # prefill, then into the run-ahead decode
    for _ in range(WARMUP_STEPS):
        engine.step()
    ops = DeviceOpTimer(engine) if not profile else None
    times, cpu, rest = [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        if ops is not None:
            rest.append(cpu[-1] - ops.take())
    out: dict[str, Any] = {"timed": _summary(times), "cpu": _summary(cpu)}
    if rest:
        out["cpu_without_sampler_device_ops"] = _summary(rest)
    if breakdown and not profile:
        parts = Breakdown(engine)
        for _ in range(steps):
            engine.step()
            parts.end_step()
        out["breakdown_cpu_median_us"] = parts.summary()
    assert len(engine.scheduler.running) == seqs, "every sequence must decode in every step"
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            engine.step()
        prof.disable()
        out["by_tottime"] = _profile_rows(prof, "tottime", steps)
        out["by_cumtime"] = _profile_rows(prof, "cumtime", steps)
    engine.abort_all()
    engine.shutdown()
    return out


# ---- serving: EngineCore.run() with a front end in another process ----

def _front_end(conn_out: Any, conn_in: Any, results: Any, reqs: list, total_steps: int) -> None:
    """Send the requests, drain the step messages (keeping their stamps), stop the engine
    after ``total_steps`` steps, and send the stamps back."""
    from detlora.engine.core_proc import AddRequest

    for k, (prompt, params, lora) in enumerate(reqs):
        conn_out.send(("add", AddRequest(str(k), prompt, params, lora)))
    stamps: list[tuple[float, float | None, int]] = []
    while len(stamps) < total_steps:
        msg = conn_in.recv()
        if msg[0] == "step" and msg[5] is not None:
            stamps.append((msg[9], msg[5], len(msg[1])))
    conn_out.send(("shutdown", False))
    results.send(stamps)
    try:
        while True:
            conn_in.recv()
    except EOFError:
        pass


class _StampedSend:
    """The core's end of its output pipe, noting the wall and this thread's CPU clock at
    each step message it sends; ``profile`` runs from the ``start``-th such message on."""

    def __init__(self, conn: Any, profile: cProfile.Profile | None = None,
                 start: int = 0) -> None:
        self._conn = conn
        self.stamps: list[tuple[float, float]] = []
        self._profile, self._start = profile, start

    def send(self, msg: tuple) -> None:
        if msg[0] == "step" and msg[5] is not None:
            self.stamps.append((time.perf_counter(), time.thread_time()))
            if self._profile is not None and len(self.stamps) == self._start:
                self._profile.enable()
        self._conn.send(msg)


def run_serving(model_dir: Path, adapters: list[Path] | None, seqs: int, steps: int,
                profile: bool, max_loras: int = 2) -> dict[str, Any]:
    from detlora.config import RequestOutputKind
    from detlora.engine.core_proc import EngineCore

    engine = build_engine(model_dir, seqs, adapters is not None, max_loras)
    total = steps + 2 * WARMUP_STEPS
    if total + 4 > MAX_TOKENS:
        raise ValueError(f"--steps {steps}: every sequence must decode in every step")
    reqs = requests(engine, seqs, MAX_TOKENS, adapters, RequestOutputKind.DELTA)
    ctx = mp.get_context("spawn")
    core_in, front_out = ctx.Pipe(duplex=False)
    front_in, core_out = ctx.Pipe(duplex=False)
    res_in, res_out = ctx.Pipe(duplex=False)
    front = ctx.Process(target=_front_end, args=(front_out, front_in, res_out, reqs, total))
    front.start()
    front_out.close()
    front_in.close()
    res_out.close()
    # Profiled: the steps after the warm-up (not the prefill), to the loop's end.
    prof = cProfile.Profile() if profile else None
    stamped = _StampedSend(core_out, prof, 2 * WARMUP_STEPS)
    core = EngineCore(engine, core_in, stamped)
    core.run()
    if prof is not None:
        prof.disable()
    core_out.close()
    stamps = res_in.recv()
    front.join()
    # The loop's iteration: from one step message's sending to the next's.
    timed = stamps[2 * WARMUP_STEPS:]
    loop = stamped.stamps[2 * WARMUP_STEPS:]
    out: dict[str, Any] = {
        "loop": _summary([b[0] - a[0] for a, b in itertools.pairwise(loop)]),
        "loop_cpu": _summary([b[1] - a[1] for a, b in itertools.pairwise(loop)]),
        "step_and_deltas": _summary([s[1] for s in timed]),
        "rows_per_step": statistics.fmean(s[2] for s in timed),
        "profiled": profile,
    }
    if prof is not None:
        out["by_tottime"] = _profile_rows(prof, "tottime", total - 2 * WARMUP_STEPS)
        out["by_cumtime"] = _profile_rows(prof, "cumtime", total - 2 * WARMUP_STEPS)
    engine.shutdown()
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--paths", default="offline,step_delta,serving")
    ap.add_argument("--profile", action="store_true", help="add a cProfile pass")
    ap.add_argument("--no-lora", action="store_true", help="base model only, no adapters")
    ap.add_argument("--max-loras", type=int, default=2,
                    help="adapter slots (two adapters are in use whatever the slots)")
    ap.add_argument("--breakdown", action="store_true",
                    help="offline: a second pass timing a few engine functions")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from detlora.entrypoints.demo import build_demo_assets

    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, adapter_dirs = build_demo_assets(Path(tmp) / "tiny")
        adapters = None if args.no_lora else adapter_dirs
        for path in args.paths.split(","):
            run = {"offline": run_offline, "step_delta": run_offline,
                   "serving": run_serving}[path]
            kw: dict[str, Any] = {"delta": True} if path == "step_delta" else {}
            kw["max_loras"] = args.max_loras
            if args.breakdown and path == "offline":
                kw["breakdown"] = True
            rows[path] = run(model_dir, adapters, args.seqs, args.steps, False, **kw)
            if args.profile:
                rows[path]["profile"] = run(model_dir, adapters, args.seqs, args.steps // 3,
                                            True, **{k: v for k, v in kw.items()
                                                     if k != "breakdown"})
            print(path, json.dumps({k: v for k, v in rows[path].items()
                                    if k != "profile"}), flush=True)
    meta = {"seqs": args.seqs, "steps": args.steps, "lora": not args.no_lora,
            "max_loras": args.max_loras,
            "torch_threads": 1, "python": sys.version.split()[0], "torch": torch.__version__}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
