"""Many adapters behind one base model: traffic over a thousand adapters, what idle slots cost,
and the bits that must not move.

traffic     Qwen3-0.6B shape (Llama layout, random bf16 weights), 1,000 adapters written here
            with safetensors (ranks 8/16/32/64, target sets q|v, q|k|v|o or all seven, every
            third rsLoRA) and registered by path without being read; 512 requests (32 random
            prompt tokens, 32 greedy output tokens, EOS ignored) whose adapters follow a Zipf law
            (s = 1) or a uniform law over the 1,000, or a uniform law over 6 x max_loras of them
            (a working set of six times the slots); max_loras 8 and 32, batch_invariant, engine
            defaults otherwise (256 sequences, 8192 tokens a step). output tok/s = 512 x 32 /
            the wall time of one generate call (adapter reads and copies included), vs_single
            = that over the same requests all on one adapter (the median of three calls);
            each row adds the engine's adapter counters for the call and its steps. One
            engine per max_loras runs an untimed single-adapter call first, then in order:
            single, working set, Zipf, uniform (its host cache stays warm between calls).
            Each law runs twice: pass 1
            meets its adapters first (read from disk unless an earlier row read them), pass
            2 sends the same requests again with every adapter in the host cache (the steady
            state of a service whose working set fits host memory): slot swaps cost a copy.
slot_cost   Llama-3.1-8B and Llama-3.2-3B shapes (random bf16 weights, tied embeddings), one
            rank-16 adapter on all seven projections in use, max_loras 1, 8, 32, 64
            (batch_invariant; run_to_run at 1 and 64 for the 8B), batch 1 and 64, 32-token
            prompts: TPOT = (t(32 tokens) - t(1 token)) / 31 (medians of 3 generate calls),
            and ``replay_us``: one decode graph replay of that batch (median of 30 CUDA-event
            timings), the step's GPU time without the host.
invariance  token ids and logprobs compared with == (``differing`` of ``comparisons``): an
            adapter's 8 prompts alone in slot 0 against the same in slot 7 beside 7 others,
            after an eviction (copied back from host memory), after leaving the host cache
            (read from disk again), with 63 others resident at max_loras 64, and slot 0 against
            slot 7 at run_to_run (the same batch); 16 requests of the Zipf traffic run alone
            afterwards against their outputs in it; the Zipf run at max_loras 8 against 32
            (the same adapter for every request in both: the draws do not follow max_loras);
            each law's pass 2 against its pass 1 (other swaps, adapters from the host cache).

    {"meta": {...}, "traffic": [{"model", "adapters", "distribution", "max_loras", "pass",
     "output_tok_per_s", "vs_single", ...}], "slot_cost": [{"model", "max_loras", "batch",
     "level", "tpot_ms", "replay_us"}], "invariance": [{"check", "comparisons", "differing"}]}

    python -m benchmarks.suites.multi_lora --out benchmarks/results/multi_lora.json \
        [--parts traffic,slot_cost,invariance]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.suites.engine import ModelShape, count_differing, free_gpu, write_model

PARTS = ("traffic", "slot_cost", "invariance")
QWEN3_06B = ModelShape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                       intermediate=3072, vocab=151936, rank=16, alpha=32)
LLAMA_8B = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                      intermediate=14336, vocab=128256, rank=16, alpha=32)
LLAMA_3B = ModelShape()  # Llama-3.2-3B
TARGET_SETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"),
               ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


@dataclass(frozen=True)
class Plan:
    traffic_model: tuple[str, ModelShape] = ("Qwen3-0.6B", QWEN3_06B)
    adapters: int = 1000
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    rank_weights: tuple[float, ...] = (0.4, 0.3, 0.2, 0.1)
    target_weights: tuple[float, ...] = (0.5, 0.3, 0.2)  # q|v, q|k|v|o, all seven
    requests: int = 512
    prompt_len: int = 32
    output_len: int = 32
    traffic_max_loras: tuple[int, ...] = (8, 32)
    zipf_s: float = 1.0
    working_set_factor: int = 6
    slot_models: tuple[tuple[str, ModelShape], ...] = (("Llama-3.1-8B", LLAMA_8B),
                                                       ("Llama-3.2-3B", LLAMA_3B))
    slot_max_loras: tuple[int, ...] = (1, 8, 32, 64)
    slot_run_to_run_max_loras: tuple[int, ...] = (1, 64)  # for the first model only
    slot_batches: tuple[int, ...] = (1, 64)
    trials: int = 3
    invariance_prompts: int = 8
    traffic_vs_alone: int = 16
    device: str = "auto"

    @classmethod
    def tiny(cls) -> Plan:
        """A CPU-sized plan (tests/lab): every code path, tiny shapes."""
        shape = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                           intermediate=128, vocab=256, rank=4, alpha=8)
        return cls(traffic_model=("tiny", shape), adapters=72, ranks=(2, 4, 8), rank_weights=(
            0.5, 0.3, 0.2), requests=16, prompt_len=4, output_len=3, traffic_max_loras=(2,),
            slot_models=(("tiny", shape),), slot_max_loras=(1, 4), slot_run_to_run_max_loras=(1,),
            slot_batches=(1, 4), trials=1, invariance_prompts=2, traffic_vs_alone=4,
            device="cpu")


# ----------------------------------------------------------------------------- assets


def write_adapters(root: Path, shape: ModelShape, plan: Plan, seed: int = 0) -> list[Any]:
    """``plan.adapters`` PEFT adapters of assorted ranks and targets (drawn on the GPU when
    there is one), each written with safetensors; their LoRARequests (ids 1..n)."""
    from safetensors.torch import save_file

    from detlora import LoRARequest

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pick = random.Random(seed)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    dims = {"q_proj": (shape.hidden, q), "k_proj": (shape.hidden, kv),
            "v_proj": (shape.hidden, kv), "o_proj": (q, shape.hidden),
            "gate_proj": (shape.hidden, shape.intermediate),
            "up_proj": (shape.hidden, shape.intermediate),
            "down_proj": (shape.intermediate, shape.hidden)}
    g = torch.Generator(device=dev).manual_seed(seed)
    requests = []
    for i in range(plan.adapters):
        rank = pick.choices(plan.ranks, plan.rank_weights)[0]
        targets = pick.choices(TARGET_SETS, plan.target_weights)[0]
        shapes = {}
        for layer in range(shape.layers):
            for name in targets:
                fin, fout = dims[name]
                part = "self_attn" if name in TARGET_SETS[1] else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                shapes[f"{key}.lora_A.weight"] = (rank, fin, fin ** -0.5)
                shapes[f"{key}.lora_B.weight"] = (fout, rank, 0.02)
        flat = torch.randn(sum(a * b for a, b, _ in shapes.values()), generator=g, device=dev)
        flat = flat.to(torch.bfloat16).cpu()
        tensors, at = {}, 0
        for key, (a, b, std) in shapes.items():
            tensors[key] = flat[at: at + a * b].view(a, b) * std
            at += a * b
        path = root / f"adapter{i:04d}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules":
            list(targets), "use_rslora": i % 3 == 2, "bias": "none", "task_type": "CAUSAL_LM"}))
        requests.append(LoRARequest(f"adapter{i:04d}", i + 1, str(path)))
    return requests


def _scratch_dir(need_bytes: int) -> str | None:
    """/dev/shm when it has room (the adapters are read back from memory), else the default."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 2 * need_bytes:
        return str(shm)
    return None


# ----------------------------------------------------------------------------- engines


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _llm(model: Path, plan: Plan, **kw: Any) -> Any:
    from detlora import LLM

    args = dict(enable_lora=True, max_lora_rank=max(plan.ranks), device=plan.device,
                max_model_len=plan.prompt_len + plan.output_len + 16,
                enable_prefix_caching=False)
    return LLM(str(model), **{**args, **kw})


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def _params(plan: Plan, tokens: int | None = None) -> Any:
    from detlora import SamplingParams

    return SamplingParams(max_tokens=tokens or plan.output_len, ignore_eos=True, logprobs=0,
                          temperature=0.0)


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


# ----------------------------------------------------------------------------- traffic


def _distributions(plan: Plan, max_loras: int, seed: int = 0
                   ) -> dict[str, tuple[int, list[int]]]:
    """name -> (adapters drawn from, the adapter index of each request).

    Each law draws from its own generator seeded by ``seed`` alone: the Zipf and uniform picks
    are the same at every ``max_loras`` (only the working set's size follows it), so the runs
    at two slot counts serve every request with the same adapter and their outputs can be
    compared bit for bit."""
    n, r = plan.adapters, plan.requests

    def gen(law: int) -> torch.Generator:
        return torch.Generator().manual_seed(4 * seed + law)

    zipf = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** plan.zipf_s
    ws = min(n, plan.working_set_factor * max_loras)
    return {
        "single": (1, [0] * r),
        "working_set_uniform": (ws, torch.randint(0, ws, (r,), generator=gen(1)).tolist()),
        "zipf": (n, torch.multinomial(zipf, r, replacement=True, generator=gen(2)).tolist()),
        "uniform": (n, torch.randint(0, n, (r,), generator=gen(3)).tolist()),
    }


def traffic(model: Path, adapters: list[Any], plan: Plan,
            log: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The traffic rows, and the invariance rows it can give (traffic against alone, max_loras
    against max_loras)."""
    name, shape = plan.traffic_model
    prompts = _prompts(plan.requests, plan.prompt_len, shape.vocab, seed=1)
    params = _params(plan)
    rows: list[dict[str, Any]] = []
    invariance: list[dict[str, Any]] = []
    zipf_outputs: dict[int, tuple[list[int], list[Any]]] = {}
    for ml in plan.traffic_max_loras:
        t0 = time.perf_counter()
        kv = None if plan.device == "cpu" else 256 * -(-(plan.prompt_len + plan.output_len)
                                                      // 16) + 256
        llm = _llm(model, plan, max_loras=ml, num_kv_blocks=kv)
        for r in adapters:
            llm.register_lora(r)
        log(f"traffic max_loras {ml}: engine up and {len(adapters)} adapters registered in "
            f"{time.perf_counter() - t0:.1f} s")
        eng = llm.engine
        # Warm-up: the single-adapter call itself, so that every step shape it compiles is
        # compiled before any timed call (16 requests left the first engine's timed single
        # call 6.5x slower than the second engine's on the H200, inflating vs_single).
        llm.generate(prompts, params, [adapters[0]] * len(prompts), use_tqdm=False)
        single_tps = None
        for dist, (drawn, picks) in _distributions(plan, ml).items():
            loras = [adapters[k] for k in picks]
            first: list[Any] = []
            for pass_ in (1,) if dist == "single" else (1, 2):
                before = eng.lora_stats.as_dict()
                steps = eng.num_steps
                walls = []
                # The reference is the median of three calls (one call varied 0.45-0.87 s
                # between runs on the H200); every other row is one call.
                for _ in range(3 if dist == "single" else 1):
                    _sync()
                    t = time.perf_counter()
                    outs = llm.generate(prompts, params, loras, use_tqdm=False)
                    _sync()
                    walls.append(time.perf_counter() - t)
                wall = sorted(walls)[len(walls) // 2]
                after = eng.lora_stats.as_dict()
                tps = plan.requests * plan.output_len / wall
                single_tps = tps if dist == "single" else single_tps
                row = {"model": name, "adapters": drawn, "distribution": dist,
                       "max_loras": ml, "pass": pass_, "output_tok_per_s": round(tps, 1),
                       "vs_single": round(tps / single_tps, 3) if single_tps else None,
                       "seconds": round(wall, 3), "distinct_adapters": len(set(picks)),
                       "calls_s": [round(w, 3) for w in walls],
                       "steps": (eng.num_steps - steps) // len(walls),
                       **{k: round((after[k] - before[k]) / len(walls), 4) for k in after}}
                rows.append(row)
                log(f"  {dist:20s} over {drawn:4d} pass {pass_}: {tps:9.1f} tok/s "
                    f"({row['vs_single']}x single), {row['steps']} steps, {row['swaps']} swaps "
                    f"({row['prefetch_swaps']} ahead), {row['disk_loads']} reads, host "
                    f"{row['host_hits']}/{row['host_misses']}")
                if pass_ == 1:
                    first = outs
                else:  # swaps and host-cache hits change no bit
                    differing = count_differing(first, outs)
                    invariance.append({"check": f"{dist}_pass_2_vs_1_max_loras_{ml}",
                                       "comparisons": len(outs), "differing": differing})
                    log(f"  {dist} pass 2 against pass 1: {differing}/{len(outs)} differ")
            outs = first
            if dist == "zipf":
                zipf_outputs[ml] = (picks, outs)
                picked = random.Random(ml).sample(range(plan.requests),
                                                  min(plan.traffic_vs_alone, plan.requests))
                alone = [llm.generate(prompts[k], params, loras[k], use_tqdm=False)[0]
                         for k in picked]
                differing = count_differing(alone, [outs[k] for k in picked])
                invariance.append({"check": f"zipf_traffic_vs_alone_max_loras_{ml}",
                                   "comparisons": len(picked), "differing": differing})
                log(f"  zipf requests alone afterwards: {differing}/{len(picked)} differ")
        del llm, eng
        _free()
    if len(zipf_outputs) > 1:
        (a, (picks_a, outs_a)), (b, (picks_b, outs_b)) = list(zipf_outputs.items())[:2]
        # Only the same request with the same adapter must give the same bits.
        if picks_a != picks_b:
            raise RuntimeError(f"the Zipf runs at max_loras {a} and {b} drew other adapters")
        differing = count_differing(outs_a, outs_b)
        invariance.append({"check": f"zipf_traffic_max_loras_{a}_vs_{b}",
                           "comparisons": len(outs_a), "differing": differing})
        log(f"  zipf traffic, max_loras {a} vs {b}: {differing}/{len(outs_a)} differ")
    return rows, invariance


# ----------------------------------------------------------------------------- slot cost


def slot_cost(root: Path, plan: Plan, log: Callable[[str], None],
              rows: list[dict[str, Any]] | None = None,
              checkpoint: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """The sweep's rows, appended to ``rows`` as they come (``checkpoint`` after each
    engine, so a run cut short keeps what it measured)."""
    from benchmarks.suites.engine import write_adapter

    rows = [] if rows is None else rows
    for name, shape in plan.slot_models:
        t0 = time.perf_counter()
        model = root / f"slot_{name}"
        write_model(model, shape)
        write_adapter(root / f"slot_{name}_adapter", shape, seed=3)
        log(f"slot cost {name}: model and adapter written in {time.perf_counter() - t0:.0f} s")
        from detlora import LoRARequest

        lora = LoRARequest("slot", 1, str(root / f"slot_{name}_adapter"))
        prompts = _prompts(max(plan.slot_batches), plan.prompt_len, shape.vocab, seed=2)
        configs = [("batch_invariant", ml) for ml in plan.slot_max_loras]
        if name == plan.slot_models[0][0]:
            configs += [("run_to_run", ml) for ml in plan.slot_run_to_run_max_loras]
        for level, ml in configs:
            t0 = time.perf_counter()
            kv = None if plan.device == "cpu" else max(plan.slot_batches) * -(
                -(plan.prompt_len + plan.output_len) // 16) + 64
            llm = _llm(model, plan, max_loras=ml, max_lora_rank=shape.rank, determinism=level,
                       max_num_seqs=max(plan.slot_batches), num_kv_blocks=kv,
                       max_num_batched_tokens=max(plan.slot_batches) * plan.prompt_len)
            init = time.perf_counter() - t0
            for b in plan.slot_batches:
                rows.append(_slot_row(llm, name, level, ml, b, prompts[:b], lora, plan))
                r = rows[-1]
                log(f"  {name} {level:15s} max_loras {ml:2d} batch {b:2d}: TPOT "
                    f"{r['tpot_ms']:.3f} ms, replay {r['replay_us']} us (engine up in "
                    f"{init:.0f} s)")
            del llm
            _free()
            if checkpoint:
                checkpoint()
        shutil.rmtree(model, ignore_errors=True)  # the disk holds one large model at a time
    return rows


def _slot_row(llm: Any, name: str, level: str, ml: int, b: int, prompts: list[list[int]],
              lora: Any, plan: Plan) -> dict[str, Any]:
    full, one = _params(plan), _params(plan, 1)

    def gen(params: Any) -> None:
        llm.generate(prompts, params, [lora] * b, use_tqdm=False)

    gen(full)  # warm-up: kernels, the adapter in its slot
    times: dict[int, list[float]] = {1: [], plan.output_len: []}
    for _ in range(plan.trials):
        for tokens, params in ((1, one), (plan.output_len, full)):
            _sync()
            t = time.perf_counter()
            gen(params)
            _sync()
            times[tokens].append(time.perf_counter() - t)
    t1, tn = statistics.median(times[1]), statistics.median(times[plan.output_len])
    replay = None
    graphs = llm.engine.runner.graphs
    if graphs is not None and graphs.last_replayed is not None:
        # The last step was a decode of these b rows with the adapter: replay its graph.
        replay = round(event_us(graphs.graphs[graphs.last_replayed].replay), 1)
    return {"model": name, "max_loras": ml, "batch": b, "level": level,
            "tpot_ms": round(1e3 * (tn - t1) / (plan.output_len - 1), 4), "replay_us": replay,
            "trials_1_token_s": [round(t, 5) for t in times[1]],
            "trials_s": [round(t, 5) for t in times[plan.output_len]]}


# ----------------------------------------------------------------------------- invariance


def invariance(model: Path, adapters: list[Any], plan: Plan,
               log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Slots, residents, evictions and copies back change no bit."""
    _, shape = plan.traffic_model
    n = plan.invariance_prompts
    prompts = _prompts(n, plan.prompt_len, shape.vocab, seed=3)
    params = _params(plan)
    target, others = adapters[0], adapters[1:]
    rows: list[dict[str, Any]] = []

    def gen(llm: Any, lora: Any) -> list[Any]:
        return llm.generate(prompts, params, [lora] * n, use_tqdm=False)

    def fill(llm: Any, loras: Sequence[Any]) -> None:
        llm.generate(_prompts(len(loras), plan.prompt_len, shape.vocab, seed=4), params,
                     list(loras), use_tqdm=False)

    def check(name: str, got: list[Any], ref: list[Any], setup: bool) -> None:
        """``setup``: the engine was in the state the check names (slot, residents, cache)."""
        rows.append({"check": name, "comparisons": len(ref),
                     "differing": count_differing(got, ref), "setup_as_named": setup})
        log(f"  {name:32s} {rows[-1]['differing']}/{len(ref)} differ"
            f"{'' if setup else ' (the engine was not in the state named!)'}")

    for level in ("batch_invariant", "run_to_run"):
        llm = _llm(model, plan, max_loras=8, max_cpu_loras=16, determinism=level)
        manager = llm.engine.lora_manager
        ref = gen(llm, target)
        slot0 = manager.slot_of(target.id) == 0
        llm.remove_lora(target.id)  # forgotten: slot, host image, registration
        fill(llm, others[:7])
        got = gen(llm, target)
        check(f"{level}_slot_0_vs_7", got, ref, slot0 and manager.slot_of(target.id) == 7)
        if level == "batch_invariant":
            fill(llm, others[7:15])
            cached = target.id in manager.host.cached() and manager.slot_of(target.id) is None
            check("evicted_copied_back_from_host", gen(llm, target), ref, cached)
            fill(llm, others[15:31])
            gone = target.id not in manager.host.cached()
            check("evicted_read_again_from_disk", gen(llm, target), ref, gone)
            bi_ref = ref
        del llm, manager
        _free()
    llm = _llm(model, plan, max_loras=64)
    fill(llm, others[:63])
    got = gen(llm, target)
    check("63_others_resident_max_loras_64", got, bi_ref,
          len(llm.engine.lora_manager.resident()) == 64)
    del llm
    _free()
    return rows


# ----------------------------------------------------------------------------- run


def _free() -> None:
    if torch.cuda.is_available():
        free_gpu()


def run(plan: Plan, parts: Sequence[str] = PARTS, log: Callable[[str], None] = print,
        checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    result: dict[str, Any] = {"traffic": [], "slot_cost": [], "invariance": []}
    timings: dict[str, float] = {}
    name, shape = plan.traffic_model
    with tempfile.TemporaryDirectory(prefix="detlora-multi-lora-",
                                     dir=_scratch_dir(20 << 30)) as tmp:
        root = Path(tmp)
        if "traffic" in parts or "invariance" in parts:
            t0 = time.perf_counter()
            write_model(root / "traffic_model", shape)
            adapters = write_adapters(root / "adapters", shape, plan)
            size = sum(f.stat().st_size for f in (root / "adapters").rglob("*.safetensors"))
            timings["write_traffic_assets_s"] = round(time.perf_counter() - t0, 1)
            log(f"{name}: model and {len(adapters)} adapters ({size / 1e9:.2f} GB) written in "
                f"{timings['write_traffic_assets_s']} s")
            result["adapter_bytes"] = size
        if "traffic" in parts:
            t0 = time.perf_counter()
            rows, inv = traffic(root / "traffic_model", adapters, plan, log)
            result["traffic"] += rows
            result["invariance"] += inv
            timings["traffic_s"] = round(time.perf_counter() - t0, 1)
            if checkpoint:
                checkpoint(result)
        if "invariance" in parts:
            t0 = time.perf_counter()
            result["invariance"] += invariance(root / "traffic_model", adapters, plan, log)
            timings["invariance_s"] = round(time.perf_counter() - t0, 1)
            if checkpoint:
                checkpoint(result)
        if "slot_cost" in parts:
            t0 = time.perf_counter()
            slot_cost(root, plan, log, result["slot_cost"],
                      (lambda: checkpoint(result)) if checkpoint else None)
            timings["slot_cost_s"] = round(time.perf_counter() - t0, 1)
    timings["total_s"] = round(time.perf_counter() - started, 1)
    plan_meta = asdict(replace(plan, traffic_model=(name, asdict(shape)), slot_models=tuple(
        (n, asdict(s)) for n, s in plan.slot_models)))
    result["meta"] = {"plan": plan_meta, "parts": list(parts), "timings": timings,
                      "adapter_bytes": result.pop("adapter_bytes", None),
                      "weights": "random bf16, tied embeddings, Llama layout"}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/multi_lora.json")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized plan (code paths)")
    parser.add_argument("--slot-models", help="comma-separated subset of the slot-cost "
                        "models (" + ", ".join(n for n, _ in Plan().slot_models) + ")")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    if not args.tiny and not torch.cuda.is_available():
        parser.error("the multi-LoRA benchmark needs a CUDA GPU (--tiny runs on the CPU)")
    from benchmarks.harness import results_meta, write_results

    command = " ".join(["python -m benchmarks.suites.multi_lora", *(argv or sys.argv[1:])])
    out = Path(args.out)

    def checkpoint(partial: dict[str, Any]) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".partial.json").write_text(json.dumps(
            {"meta": {**results_meta(command), "partial": True}, **partial}, indent=1))

    plan = Plan.tiny() if args.tiny else Plan()
    if args.slot_models:
        names = args.slot_models.split(",")
        known = dict(plan.slot_models)
        if any(n not in known for n in names):
            parser.error(f"--slot-models: choose from {list(known)}, got {names}")
        plan = replace(plan, slot_models=tuple((n, known[n]) for n in names))
    result = run(plan, parts, checkpoint=checkpoint)
    result = {"meta": {**results_meta(command), **result.pop("meta")}, **result}
    write_results(out, result)
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
