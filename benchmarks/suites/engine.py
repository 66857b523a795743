"""End-to-end engine benchmark (issue 4): speed and bit-reproducibility of every level.

Model: the Llama-3.2-3B shape (hidden 3072, 28 layers, 24 q / 8 kv heads, head_dim 128,
intermediate 8192, vocab 128256, tied embeddings) with random bf16 weights written to a
temporary directory, and rank-16 PEFT adapters (alpha 32, B not zero) on all seven
projections. Prompts: 100 random token ids; 150 output tokens, EOS ignored; half greedy,
half seeded sampling (temperature 0.8, top-p 0.95); logprobs of every chosen token.

    {"meta": {..., "model"}, "roofline": {"weight_bytes", "copy_TBps", "batch1_tpot_floor_ms"},
     "throughput": [{"mode", "batch", "output_tok_per_s", "tpot_ms", "prefill_tok_per_s"}],
     "determinism": [{"mode", "check", "comparisons", "differing"}]}

Determinism (token ids and logprobs compared with == against a reference run):
``repeat``: R repetitions of the same batch of P prompts; ``cross_batch``: the P prompts in
batches of 1, 16, 32 (batch_invariant only at batch 1: it is slow); ``arrival_order``: the
batch shuffled; ``mixed_adapters``: two adapters and the base model in one batch against each
group run on its own; ``preemption``: an engine whose KV cache holds a quarter of the batch.
Speed: median of ``trials`` runs after warm-up, on one engine per level (model loads dominate
GPU time otherwise): TPOT = (t(N tokens) - t(1 token)) / (N - 1), output tok/s = B * N /
t(N), prefill tok/s = B * 100 / t(1). Hugging Face generate + PEFT is timed in the same run
(batch 1 and 64, few tokens) when transformers and peft are installed.

    python -m benchmarks.suites.engine --out benchmarks/results/engine.json [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

MODES = ("fast", "run_to_run", "batch_invariant")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 3072
    layers: int = 28
    heads: int = 24
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 8192
    vocab: int = 128256
    rank: int = 16
    alpha: int = 32
    architecture: str = "LlamaForCausalLM"  # or Qwen3ForCausalLM (per-head q/k norms)
    max_positions: int = 131072


# Model shapes the suites take by name (--shape): published configs' sizes, random weights.
SHAPES: dict[str, ModelShape] = {
    "3b": ModelShape(),  # Llama-3.2-3B
    "8b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    # SmolLM2-135M(-Instruct): hidden 576, 9 heads of 64, 3 KV heads, tied, vocab 49152.
    "smollm2": ModelShape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64,
                          intermediate=1536, vocab=49152, max_positions=8192),
    # Qwen3-0.6B: hidden 1024, 16 heads of 128, 8 KV heads, q/k norms, tied, vocab 151936.
    "qwen3-0.6b": ModelShape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                             intermediate=3072, vocab=151936,
                             architecture="Qwen3ForCausalLM", max_positions=40960),
}


@dataclass(frozen=True)
class BenchPlan:
    shape: ModelShape = ModelShape()
    prompts: int = 64
    prompt_len: int = 100
    output_len: int = 150
    repetitions: int = 10
    cross_batches: tuple[int, ...] = (1, 16, 32)
    batch1_prompts: int = 64  # prompts run alone for cross_batch at batch 1
    throughput_batches: tuple[int, ...] = (1, 16, 64, 256)
    trials: int = 3
    hf_tokens: int = 150  # as many as the engine generates: HF's steps slow as its cache grows
    hf_batches: tuple[int, ...] = (1, 64)
    hf_repetitions: int = 3

    @classmethod
    def quick(cls) -> BenchPlan:
        return cls(shape=replace(ModelShape(), layers=4), prompts=16, output_len=32,
                   repetitions=3, cross_batches=(1, 8), batch1_prompts=4,
                   throughput_batches=(1, 16, 64), trials=1, hf_tokens=8, hf_batches=(1, 16),
                   hf_repetitions=2)


# ----------------------------------------------------------------------------- assets


def write_model(path: Path, s: ModelShape, seed: int = 0) -> int:
    """Random bf16 checkpoint of shape ``s`` (Llama-3.2-3B's by default; Llama's rope and
    ids for every shape); returns its weight bytes."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    # Drawn on the GPU (6 GB in seconds); the CPU (tests, tiny shapes) draws other values.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def rnd(*size: int, std: float = 0.02) -> torch.Tensor:
        t = torch.randn(*size, generator=g, device=dev, dtype=torch.float32) * std
        return t.to(torch.bfloat16).cpu()

    w = {"model.embed_tokens.weight": rnd(s.vocab, s.hidden),
         "model.norm.weight": 1 + rnd(s.hidden, std=0.05)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + rnd(s.hidden, std=0.05),
              p + "post_attention_layernorm.weight": 1 + rnd(s.hidden, std=0.05),
              p + "self_attn.q_proj.weight": rnd(q, s.hidden),
              p + "self_attn.k_proj.weight": rnd(kv, s.hidden),
              p + "self_attn.v_proj.weight": rnd(kv, s.hidden),
              p + "self_attn.o_proj.weight": rnd(s.hidden, q),
              p + "mlp.gate_proj.weight": rnd(s.intermediate, s.hidden),
              p + "mlp.up_proj.weight": rnd(s.intermediate, s.hidden),
              p + "mlp.down_proj.weight": rnd(s.hidden, s.intermediate)}
        if s.architecture == "Qwen3ForCausalLM":
            w |= {p + "self_attn.q_norm.weight": 1 + rnd(s.head_dim, std=0.05),
                  p + "self_attn.k_norm.weight": 1 + rnd(s.head_dim, std=0.05)}
    save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": [s.architecture],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[s.architecture],
        "vocab_size": s.vocab, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "hidden_act": "silu",
        "max_position_embeddings": s.max_positions, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128001,
    }, indent=1))
    return sum(t.numel() * t.element_size() for t in w.values())


def write_adapter(path: Path, s: ModelShape, seed: int) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    dims = {"q_proj": (s.hidden, q), "k_proj": (s.hidden, kv), "v_proj": (s.hidden, kv),
            "o_proj": (q, s.hidden), "gate_proj": (s.hidden, s.intermediate),
            "up_proj": (s.hidden, s.intermediate), "down_proj": (s.intermediate, s.hidden)}
    w = {}
    for i in range(s.layers):
        for name, (fin, fout) in dims.items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            p = f"base_model.model.model.layers.{i}.{part}.{name}."
            w[p + "lora_A.weight"] = (torch.randn(s.rank, fin, generator=g) / fin**0.5).to(
                torch.bfloat16)
            w[p + "lora_B.weight"] = (torch.randn(fout, s.rank, generator=g) * 0.02).to(
                torch.bfloat16)
    save_file(w, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": s.rank, "lora_alpha": s.alpha, "target_modules": list(TARGETS),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None}))


# ----------------------------------------------------------------------------- measuring


def copy_bandwidth_tbps(nbytes: int = 2**30, reps: int = 20) -> float:
    """Device-to-device copy: (read + write) bytes per second, median of ``reps``, in TB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e12


def same_output(a: Any, b: Any) -> bool:
    x, y = a.outputs[0], b.outputs[0]
    return x.token_ids == y.token_ids and x.logprobs == y.logprobs


def count_differing(outs: Sequence[Any], ref: Sequence[Any]) -> int:
    return sum(not same_output(a, b) for a, b in zip(outs, ref, strict=True))


def free_gpu() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


class Workload:
    def __init__(self, plan: BenchPlan, loras: list[Any]) -> None:
        from detlora import SamplingParams

        self.plan = plan
        self.loras = loras
        # Row k of a batch on adapter k % len(loras), instead of the first adapter everywhere.
        self.spread = False
        n = max(plan.prompts, *plan.throughput_batches)
        g = torch.Generator().manual_seed(1234)
        self.prompts = torch.randint(10, plan.shape.vocab - 10, (n, plan.prompt_len),
                                     generator=g).tolist()

        def params(k: int, max_tokens: int) -> SamplingParams:
            if k % 2 == 0:
                return SamplingParams(temperature=0.0,
                                      max_tokens=max_tokens, ignore_eos=True, logprobs=0)
            return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                                  temperature=0.8, top_p=0.95, seed=k)

        self.params = [params(k, plan.output_len) for k in range(n)]
        self.params_1 = [params(k, 1) for k in range(n)]

    def generate(self, llm: Any, idx: Sequence[int], *, one_token: bool = False,
                 loras: Sequence[Any] | None = None) -> list[Any]:
        params = self.params_1 if one_token else self.params
        if loras is not None:
            lr: list[Any] | None = list(loras)
        elif self.spread and self.loras:
            lr = [self.loras[k % len(self.loras)] for k in range(len(idx))]
        else:  # the first adapter everywhere (none when the workload has no adapters)
            lr = [self.loras[0]] * len(idx) if self.loras else None
        return llm.generate([self.prompts[k] for k in idx], [params[k] for k in idx], lr,
                            use_tqdm=False)

    def in_batches(self, llm: Any, idx: Sequence[int], size: int) -> list[Any]:
        out: list[Any] = []
        for lo in range(0, len(idx), size):
            out += self.generate(llm, idx[lo: lo + size])
        return out


def make_engine(model_dir: Path, mode: str, plan: BenchPlan, **kw: Any) -> Any:
    from detlora import LLM

    args = dict(enable_lora=True, max_loras=2, max_lora_rank=plan.shape.rank, determinism=mode,
                max_model_len=plan.prompt_len + plan.output_len + 16,
                max_num_seqs=max(256, *plan.throughput_batches), max_num_batched_tokens=8192,
                enable_prefix_caching=False)  # repeats recompute, as the protocol asks
    return LLM(str(model_dir), **{**args, **kw})


def _row(rows: list[dict[str, Any]], log: Callable[[str], None], mode: str, check: str,
         comparisons: int, differing: int, **extra: Any) -> None:
    rows.append({"mode": mode, "check": check, "comparisons": comparisons,
                 "differing": differing, **extra})
    log(f"  {mode:16s} {check:15s} {differing}/{comparisons} differ {extra or ''}")


def _determinism(llm: Any, mode: str, w: Workload,
                 log: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Every check one engine can run; returns the rows and the reference outputs."""
    plan = w.plan
    idx = list(range(plan.prompts))
    rows: list[dict[str, Any]] = []

    def add(check: str, comparisons: int, differing: int, **extra: Any) -> None:
        _row(rows, log, mode, check, comparisons, differing, **extra)

    ref = w.generate(llm, idx)
    diff = sum(count_differing(w.generate(llm, idx), ref) for _ in range(plan.repetitions - 1))
    add("repeat", plan.prompts * (plan.repetitions - 1), diff)

    for size in plan.cross_batches:
        if size == 1 and mode != "batch_invariant":
            continue  # batch 1 is slow; the levels without the promise show it at 16 and 32
        sub = idx[: plan.batch1_prompts] if size == 1 else idx
        got = w.in_batches(llm, sub, size)
        add("cross_batch", len(sub), count_differing(got, ref[: len(sub)]), batch=size)

    order = torch.randperm(plan.prompts, generator=torch.Generator().manual_seed(7)).tolist()
    got = w.generate(llm, order)
    add("arrival_order", plan.prompts, count_differing(got, [ref[k] for k in order]))

    # Mixed adapters: a0 / a1 / base in one batch, against each group run on its own.
    choice = [w.loras[0], w.loras[1], None]
    mixed = [choice[k % 3] for k in idx]
    together = w.generate(llm, idx, loras=mixed)
    apart: dict[int, Any] = {}
    for c in range(3):
        group = [k for k in idx if k % 3 == c]
        apart.update(zip(group, w.generate(llm, group, loras=[choice[c]] * len(group)),
                         strict=True))
    add("mixed_adapters", plan.prompts, count_differing(together, [apart[k] for k in idx]))
    return rows, ref


def _preemption(model_dir: Path, mode: str, w: Workload, ref: list[Any],
                log: Callable[[str], None]) -> list[dict[str, Any]]:
    """A KV cache for a quarter of the batch: sequences are preempted and recomputed."""
    plan = w.plan
    per_seq = -(-(plan.prompt_len + plan.output_len) // 16)
    small = make_engine(model_dir, mode, plan, num_kv_blocks=per_seq * max(1, plan.prompts // 4))
    got = w.generate(small, list(range(plan.prompts)))
    rows: list[dict[str, Any]] = []
    _row(rows, log, mode, "preemption", plan.prompts, count_differing(got, ref),
         preemptions=small.engine.scheduler.num_preemptions)
    return rows


def _trial_times(fn: Callable[[], Any], trials: int) -> list[float]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(trials):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _timed(fn: Callable[[], Any], trials: int) -> float:
    return statistics.median(_trial_times(fn, trials))


def throughput_rows(llm: Any, mode: str, w: Workload,
                log: Callable[[str], None]) -> list[dict[str, Any]]:
    plan = w.plan
    rows = []
    for b in plan.throughput_batches:
        idx = list(range(b))
        w.generate(llm, idx)  # warm-up: kernels for this batch's shapes, graphs, adapters
        ones = _trial_times(lambda idx=idx: w.generate(llm, idx, one_token=True), plan.trials)
        fulls = _trial_times(lambda idx=idx: w.generate(llm, idx), plan.trials)
        t1, tn = statistics.median(ones), statistics.median(fulls)
        row = {"mode": mode, "batch": b, "output_tok_per_s": b * plan.output_len / tn,
               "tpot_ms": 1e3 * (tn - t1) / (plan.output_len - 1),
               "prefill_tok_per_s": b * plan.prompt_len / t1,
               # every trial, to judge the spread of the medians above
               "trials_one_token_s": [round(t, 5) for t in ones],
               "trials_s": [round(t, 5) for t in fulls]}
        rows.append(row)
        log(f"  {mode:16s} batch {b:4d}: {row['output_tok_per_s']:9.1f} tok/s, "
            f"TPOT {row['tpot_ms']:.2f} ms, prefill {row['prefill_tok_per_s']:.0f} tok/s")
    return rows


def _hf_peft(model_dir: Path, adapter: Path, w: Workload,
             log: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        log(f"  hf_peft skipped: {e}")
        return [{"mode": "hf_peft", "skipped": f"not installed: {e}"}], []
    plan = w.plan
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda()
    holder = {"model": PeftModel.from_pretrained(base, str(adapter)).eval()}

    def gen(b: int, n: int) -> tuple[list[list[int]], list[list[float]]]:
        ids = torch.tensor(w.prompts[:b], device="cuda")
        with torch.no_grad():
            out = holder["model"].generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0, eos_token_id=None, output_scores=True,
                return_dict_in_generate=True)
        toks = out.sequences[:, plan.prompt_len:]
        lps = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
        chosen = lps.gather(2, toks[:, :, None])[:, :, 0]
        return toks.tolist(), chosen.tolist()

    rows = []
    for b in plan.hf_batches:
        gen(b, 2)  # warm-up
        t1 = _timed(lambda b=b: gen(b, 1), plan.trials)
        tn = _timed(lambda b=b: gen(b, plan.hf_tokens), plan.trials)
        row = {"mode": "hf_peft", "batch": b, "output_tok_per_s": b * plan.hf_tokens / tn,
               "tpot_ms": 1e3 * (tn - t1) / (plan.hf_tokens - 1),
               "prefill_tok_per_s": b * plan.prompt_len / t1, "output_tokens": plan.hf_tokens}
        rows.append(row)
        log(f"  hf_peft          batch {b:4d}: {row['output_tok_per_s']:9.1f} tok/s, "
            f"TPOT {row['tpot_ms']:.2f} ms (greedy, {plan.hf_tokens} tokens)")
    b = min(16, plan.prompts)
    first = gen(b, plan.hf_tokens)
    diff = 0
    for _ in range(plan.hf_repetitions - 1):
        toks, lps = gen(b, plan.hf_tokens)
        diff += sum(t != ft or lp != fl for t, lp, ft, fl in zip(toks, lps, *first,
                                                                  strict=True))
    det = [{"mode": "hf_peft", "check": "repeat", "comparisons": b * (plan.hf_repetitions - 1),
            "differing": diff, "batch": b, "output_tokens": plan.hf_tokens, "greedy": True}]
    log(f"  hf_peft          repeat          {diff}/{b * (plan.hf_repetitions - 1)} differ")
    holder.clear()
    del base
    free_gpu()
    return rows, det


def run(log: Callable[[str], None] = print, quick: bool = False,
        checkpoint: Callable[[dict[str, Any]], None] | None = None,
        modes: Sequence[str] = MODES, hf: bool = True) -> dict[str, Any]:
    """The engine study; ``checkpoint`` receives the partial results after every stage, so a
    run cut short by a time limit still leaves what it measured."""
    if not torch.cuda.is_available():
        raise RuntimeError("the engine benchmark needs a CUDA GPU")
    from detlora import LoRARequest

    plan = BenchPlan.quick() if quick else BenchPlan()
    s = plan.shape
    started = time.perf_counter()
    throughput: list[dict[str, Any]] = []
    determinism: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="detlora-bench-engine-") as tmp:
        root = Path(tmp)
        weight_bytes = write_model(root / "model", s)
        for k in range(2):
            write_adapter(root / f"adapter{k}", s, seed=10 + k)
        loras = [LoRARequest(f"a{k}", k + 1, str(root / f"adapter{k}")) for k in range(2)]
        log(f"wrote model ({weight_bytes / 1e9:.2f} GB) and adapters in "
            f"{time.perf_counter() - started:.0f} s")
        tbps = copy_bandwidth_tbps()
        roofline = {"weight_bytes": weight_bytes, "copy_TBps": tbps,
                    "batch1_tpot_floor_ms": 1e3 * weight_bytes / (tbps * 1e12)}
        log(f"roofline: {tbps:.2f} TB/s copy, batch-1 TPOT floor "
            f"{roofline['batch1_tpot_floor_ms']:.3f} ms")
        w = Workload(plan, loras)
        engines: dict[str, Any] = {}
        for mode in modes:
            t0 = time.perf_counter()
            llm = make_engine(root / "model", mode, plan)
            engines[mode] = {"init_s": time.perf_counter() - t0,
                             "num_kv_blocks": llm.engine.num_kv_blocks,
                             "cuda_graphs": llm.engine.runner.uses_cuda_graphs,
                             "graph_error": llm.engine.runner.graph_error,
                             "backend": llm.engine.backend.describe(),
                             "fingerprint_base": llm.engine.fingerprint_of(None)}
            log(f"{mode}: engine up in {engines[mode]['init_s']:.0f} s "
                f"(graphs: {engines[mode]['cuda_graphs']})")
            throughput += throughput_rows(llm, mode, w, log)
            rows, ref = _determinism(llm, mode, w, log)
            determinism += rows
            engines[mode]["fingerprint_adapter0"] = ref[0].fingerprint
            del llm  # one engine on the GPU at a time: each takes most of its memory
            free_gpu()
            if mode == "batch_invariant":
                determinism += _preemption(root / "model", mode, w, ref, log)
                free_gpu()
            if checkpoint is not None:
                checkpoint({"meta": {"engines": engines, "partial": True}, "roofline": roofline,
                            "throughput": throughput, "determinism": determinism})
        if hf:
            hf_rows, hf_det = _hf_peft(root / "model", root / "adapter0", w, log)
            throughput += hf_rows
            determinism += hf_det
    meta = {"model": {"shape": "Llama-3.2-3B", **asdict(s), "dtype": "bfloat16",
                      "weights": "random", "tied_embeddings": True},
            "plan": {k: v for k, v in asdict(plan).items() if k != "shape"},
            "engines": engines, "quick": quick,
            "seconds": round(time.perf_counter() - started, 1)}
    return {"meta": meta, "roofline": roofline, "throughput": throughput,
            "determinism": determinism}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/engine.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="determinism levels to run (comma-separated)")
    parser.add_argument("--no-hf", action="store_true", help="skip Hugging Face + PEFT")
    args = parser.parse_args(argv)
    modes = args.modes.split(",") if args.modes else []
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    from benchmarks.harness import results_meta, write_results

    command = " ".join(["python -m benchmarks.suites.engine", *(argv or sys.argv[1:])])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def checkpoint(partial: dict[str, Any]) -> None:
        partial["meta"] = {**results_meta(command), **partial["meta"]}
        Path(args.out).with_suffix(".partial.json").write_text(json.dumps(partial, indent=1))

    result = run(quick=args.quick, checkpoint=checkpoint, modes=modes, hf=not args.no_hf)
    result["meta"] = {**results_meta(command), **result["meta"]}
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
