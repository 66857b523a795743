"""Gemma shapes of the architectures benchmark (issue 46): Gemma 4 E4B and Gemma 3 1B / 4B
with random bf16 weights and a rank-16 adapter on all seven projections.

``SHAPES`` is the registry (name -> family, config.json dict, adapter targets), joined into
benchmarks/suites/architectures.py's ``SHAPES``: that suite writes their rows of
``architectures.json`` with every other family's protocol (its prompts stay inside the
windows). This one adds what only windows have: invariance checks on prompts that cross the
window and the 32k-context TPOT, with its own rows (below). The E4B text config is the one
in the issue's reference notes (42 layers, 5:1 sliding/full, window 512, head_dim 256 / 512,
18 KV-shared layers, PLE 256, soft-cap 30); the Gemma 3 ones are the published configs'
text fields (1B: 26 layers, hidden 1152, one KV head, window 512; 4B: 34 layers, hidden
2560, window 1024, global rotary linearly scaled by 8).

Rows, one per model shape and level (``fast``, ``batch_invariant``)::

    {"model", "family", "level", "tpot_b1_ms", "roofline_b1", "tok_s_b64",
     "bi_vs_fast_b1", "bi_vs_fast_b64", "differing", "comparisons", "checks"}

* ``tpot_b1_ms``: one request (a ``prompt_len``-token prompt), (t(N tokens) - t(1)) / (N - 1),
  median of ``trials``; ``tok_s_b64``: 64 such requests, 64 N / t(N).
* ``roofline_b1``: (bytes a batch-1 decode step reads: every linear weight, the LM head, the
  adapter's A and B, the per-layer-embedding row, and the K/V each layer reads at the mean
  context of the timed tokens, a window layer at most its window) / (measured HBM copy
  bandwidth) / TPOT: 1.0 is the bandwidth limit.
* ``bi_vs_fast_*``: batch_invariant's TPOT (batch 1) and time (batch 64) over fast's.
* ``differing`` / ``comparisons``: at batch_invariant, every prompt alone is the reference
  and the same prompts batched, in reversed order, with chunked prefill (chunks across the
  window's edge), after preemption and from the prefix cache must give equal token ids and
  logprobs; prompts are longer than the window. At fast: batched against alone only.

``long_context`` rows (E4B, Gemma 3 4B): batch-1 TPOT at ``batch_invariant`` after a 4k and
a 32k-token context. Sliding layers read only their window, so the 32k TPOT should be the
4k one plus the time the full-attention layers need for their extra K/V:
``expected_ms = tpot_4k + extra_full_kv_bytes / bandwidth``, ``ratio = tpot_32k /
expected_ms`` (the target: at most 1.10).

    python -m benchmarks.suites.architectures_gemma --out out/architectures_gemma.json \\
        [--models gemma4-e4b,gemma3-1b,gemma3-4b] [--sections speed,invariance,long_context]
    python -m benchmarks.suites.architectures_gemma --smoke   # a tiny Gemma 4 on the CPU
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
from pathlib import Path
from typing import Any

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LEVELS = ("fast", "batch_invariant")
SECTIONS = ("speed", "invariance", "long_context")

_E4B_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 7
GEMMA4_E4B = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
    "vocab_size": 262144, "hidden_size": 2560, "intermediate_size": 10240,
    "num_hidden_layers": 42, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": None,
    "attention_k_eq_v": False, "layer_types": _E4B_TYPES, "sliding_window": 512,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1000000.0}},
    "num_kv_shared_layers": 18, "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144, "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
    "max_position_embeddings": 131072, "enable_moe_block": False,
    "use_double_wide_mlp": False, "hidden_activation": "gelu_pytorch_tanh",
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "torch_dtype": "bfloat16",
}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
    "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "max_position_embeddings": 32768,
    "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "torch_dtype": "bfloat16",
}
GEMMA3_4B = {
    **GEMMA3_1B, "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
    "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
    "sliding_window": 1024, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "max_position_embeddings": 131072,
}
SHAPES: dict[str, dict[str, Any]] = {
    "gemma4-e4b": {"family": "gemma4", "config": GEMMA4_E4B, "adapter_targets": list(TARGETS),
                   "long_context": True},
    "gemma3-1b": {"family": "gemma3", "config": GEMMA3_1B, "adapter_targets": list(TARGETS),
                  "long_context": False},
    "gemma3-4b": {"family": "gemma3", "config": GEMMA3_4B, "adapter_targets": list(TARGETS),
                  "long_context": True},
}
# The CPU smoke run: a tiny Gemma 4 with every feature of E4B (KV sharing, PLE, soft-cap,
# two head sizes) and a window shorter than its prompts.
SMOKE = {"family": "gemma4", "adapter_targets": list(TARGETS), "long_context": True,
         "config": {**GEMMA4_E4B, "vocab_size": 256, "vocab_size_per_layer_input": 256,
                    "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 6,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "global_head_dim": 32, "sliding_window": 8, "num_kv_shared_layers": 2,
                    "hidden_size_per_layer_input": 8, "max_position_embeddings": 512,
                    "layer_types": ["sliding_attention", "sliding_attention",
                                    "full_attention"] * 2, "torch_dtype": "float32"}}


class Plan:
    """What each section runs: the full plan on a GPU, a tiny one for the smoke run."""

    def __init__(self, smoke: bool) -> None:
        self.prompt_len = 16 if smoke else 128
        self.output_len = 4 if smoke else 64
        self.batch = 4 if smoke else 64
        self.trials = 1 if smoke else 2
        self.check_prompts = 3 if smoke else 16
        self.check_tokens = 3 if smoke else 32
        self.contexts = (24, 96) if smoke else (4096, 32768)
        self.context_tokens = 3 if smoke else 32
        self.rank = 4 if smoke else 16


# ----------------------------------------------------------------------------- weights


def _fp32(config: dict[str, Any]) -> bool:
    return "float32" in (config.get("torch_dtype"), config.get("dtype"))


def _model_on_meta(config: dict[str, Any]) -> Any:
    from detlora.layers.backend import make_backend
    from detlora.models.loader import ARCHITECTURES
    from detlora.models.spec import ModelSpec

    spec = ModelSpec.from_config(config)
    return ARCHITECTURES[spec.architecture](spec, backend=make_backend("cpu"),
                                            dtype=torch.bfloat16, device="meta",
                                            max_positions=2)


def write_checkpoint(path: Path, config: dict[str, Any], *, seed: int = 0,
                     shard_bytes: int = 4 << 30) -> int:
    """Random weights for every tensor the loader expects of ``config`` (linear weights and
    embeddings N(0, 0.02^2), norms near their identity, layer scalars 1), in safetensors
    shards with an index; drawn on the GPU when there is one. Returns the weight bytes."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    dtype = torch.float32 if _fp32(config) else torch.bfloat16
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    unit = "Gemma3" in config["architectures"][0]  # norms scale by 1 + w there
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, (shape, _) in _model_on_meta(config).hf_weights().items():
        t = torch.randn(*shape, generator=g, device=dev)
        if name.endswith("layer_scalar"):
            t = torch.ones(shape, device=dev)
        elif name.endswith("norm.weight"):
            t = t * 0.05 + (0.0 if unit else 1.0)
        else:
            t = t * 0.02
        t = t.to(dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return total


def write_adapter(path: Path, model_dir: Path, *, targets: Sequence[str], rank: int,
                  seed: int = 1) -> int:
    """A PEFT adapter of ``rank`` on ``targets`` of every layer that has them (A of scale
    1/sqrt(in), B of 0.02), in the model dtype. Returns its bytes."""
    from safetensors.torch import save_file

    from detlora.models.loader import lora_target_shapes_of
    from detlora.models.spec import ModelSpec

    spec = ModelSpec.from_dir(model_dir)
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}
    for module, (fin, fout) in lora_target_shapes_of(spec).items():
        if module.rpartition(".")[2] in targets:
            p = f"base_model.model.{module}."
            w[p + "lora_A.weight"] = (torch.randn(rank, fin, generator=g) / fin**0.5).to(
                spec.dtype)
            w[p + "lora_B.weight"] = (torch.randn(fout, rank, generator=g) * 0.02).to(
                spec.dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(w, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))
    return sum(t.numel() * t.element_size() for t in w.values())


# ----------------------------------------------------------------------------- bytes


def decode_bytes(config: dict[str, Any], context: int, adapter_bytes: int) -> int:
    """Bytes a batch-1 decode step at ``context`` reads (see the module docstring)."""
    from detlora.layers.linear import LinearBase
    from detlora.models.spec import ModelSpec

    model = _model_on_meta(config)
    spec = ModelSpec.from_config(config)
    elem = 4 if _fp32(config) else 2
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, LinearBase))
    head = spec.vocab_size * spec.hidden_size
    ple = model.per_layer_embedding
    ple_row = 0 if ple is None else ple.num_layers * ple.size
    kv = 0
    for i in range(spec.num_layers):
        a = spec.attention(i)
        keys = context if a.window is None else min(context, a.window)
        kv += 2 * keys * a.num_kv_heads * a.head_dim
    return (linear + head + ple_row + kv) * elem + adapter_bytes


def full_kv_bytes_per_token(config: dict[str, Any]) -> int:
    """K/V bytes per context token that full-attention layers read (KV-shared ones too)."""
    from detlora.models.spec import ModelSpec

    spec = ModelSpec.from_config(config)
    elem = 4 if _fp32(config) else 2
    return sum(2 * a.num_kv_heads * a.head_dim * elem
               for a in map(spec.attention, range(spec.num_layers)) if a.window is None)


# ----------------------------------------------------------------------------- running


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _bandwidth() -> float | None:
    if not torch.cuda.is_available():
        return None
    from benchmarks.suites.engine import copy_bandwidth_tbps

    return copy_bandwidth_tbps() * 1e12


def _prompts(n: int, lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 3, (lengths[k % len(lengths)],), generator=g).tolist()
            for k in range(n)]


def _params(n_tokens: int, k: int) -> Any:
    from detlora import SamplingParams

    if k % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True, logprobs=0)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=k, max_tokens=n_tokens,
                          ignore_eos=True, logprobs=0)


def _engine(model_dir: Path, level: str, plan: Plan, **kw: Any) -> Any:
    from detlora import LLM

    args = dict(enable_lora=True, max_loras=2, max_lora_rank=plan.rank, determinism=level,
                max_num_seqs=max(plan.batch, plan.check_prompts), enable_prefix_caching=False,
                max_model_len=2048 if torch.cuda.is_available() else 256)
    if not torch.cuda.is_available():
        args["device"] = "cpu"
    return LLM(str(model_dir), **{**args, **kw})


def _timed(fn: Callable[[], Any], trials: int) -> float:
    times = []
    for _ in range(trials):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tpot(llm: Any, prompts: list[list[int]], lora: Any, n: int, trials: int) -> float:
    """(t(n tokens) - t(1 token)) / (n - 1) of ``prompts`` in one batch, in seconds."""
    def run(tokens: int) -> None:
        llm.generate(prompts, [_params(tokens, 0)] * len(prompts), [lora] * len(prompts),
                     use_tqdm=False)

    run(2)  # warm-up
    return (_timed(lambda: run(n), trials) - _timed(lambda: run(1), trials)) / (n - 1)


def _same(a: Any, b: Any) -> bool:
    x, y = a.outputs[0], b.outputs[0]
    return x.token_ids == y.token_ids and x.logprobs == y.logprobs


def speed_row(name: str, shape: dict[str, Any], model_dir: Path, lora: Any, level: str,
              plan: Plan, bandwidth: float | None, adapter_bytes: int) -> dict[str, Any]:
    cfg = shape["config"]
    llm = _engine(model_dir, level, plan)
    prompts = _prompts(plan.batch, [plan.prompt_len], cfg["vocab_size"], seed=7)
    tpot = _tpot(llm, prompts[:1], lora, plan.output_len, plan.trials)
    params = [_params(plan.output_len, k) for k in range(plan.batch)]
    llm.generate(prompts, params, [lora] * plan.batch, use_tqdm=False)  # warm-up
    t64 = _timed(lambda: llm.generate(prompts, params, [lora] * plan.batch, use_tqdm=False),
                 plan.trials)
    context = plan.prompt_len + plan.output_len // 2
    step_bytes = decode_bytes(cfg, context, adapter_bytes)
    row = {"model": name, "family": shape["family"], "level": level,
           "tpot_b1_ms": 1e3 * tpot,
           "roofline_b1": None if bandwidth is None else step_bytes / bandwidth / tpot,
           "tok_s_b64": plan.batch * plan.output_len / t64, "batch_s_b64": t64,
           "decode_bytes_b1": step_bytes, "cuda_graphs": llm.engine.runner.uses_cuda_graphs}
    llm = None  # one engine on the GPU at a time
    _free()
    return row


def invariance_checks(shape: dict[str, Any], model_dir: Path, lora: Any, level: str,
                      plan: Plan, thorough: bool) -> tuple[int, int, dict[str, list[int]]]:
    """(differing, comparisons, per check [differing, comparisons]) of ``plan.check_prompts``
    prompts longer than the window, every other one on the adapter."""
    cfg = shape["config"]
    window = cfg["sliding_window"]
    lengths = [window + d for d in (-3, 5, 37, 100, 161)]
    if plan.check_prompts <= 4:  # the smoke run's windows are tiny
        lengths = [window + 3, window + 9, 2 * window + 1]
    prompts = _prompts(plan.check_prompts, lengths, cfg["vocab_size"], seed=11)
    loras = [lora if k % 2 else None for k in range(len(prompts))]
    params = [_params(plan.check_tokens, k) for k in range(len(prompts))]
    llm = _engine(model_dir, level, plan)
    alone = [llm.generate(p, s, r, use_tqdm=False)[0]
             for p, s, r in zip(prompts, params, loras, strict=True)]
    checks: dict[str, list[int]] = {}

    def check(label: str, outs: list[Any], ref: list[Any]) -> None:
        checks[label] = [sum(not _same(a, b) for a, b in zip(outs, ref, strict=True)),
                         len(ref)]

    check("batch", llm.generate(prompts, params, loras, use_tqdm=False), alone)
    if thorough:
        order = list(reversed(range(len(prompts))))
        check("order", llm.generate([prompts[k] for k in order], [params[k] for k in order],
                                    [loras[k] for k in order], use_tqdm=False),
              [alone[k] for k in order])
    del llm
    _free()
    if thorough:
        variants = {
            "chunked": dict(max_num_batched_tokens=max(64, window // 2 + 17)),
            "preemption": dict(num_kv_blocks=max(2 * (max(lengths) + plan.check_tokens) // 16,
                                                 8), block_size=16),
            "prefix_cache": dict(enable_prefix_caching=True),
        }
        for label, kw in variants.items():
            llm = _engine(model_dir, level, plan, enforce_eager=True, **kw)
            outs = llm.generate(prompts, params, loras, use_tqdm=False)
            if label == "prefix_cache":  # the second run reads the cached pages
                outs = llm.generate(prompts, params, loras, use_tqdm=False)
            check(label, outs, alone)
            del llm
            _free()
    return (sum(d for d, _ in checks.values()), sum(c for _, c in checks.values()), checks)


def long_context_rows(name: str, shape: dict[str, Any], model_dir: Path, lora: Any,
                      plan: Plan, bandwidth: float | None) -> list[dict[str, Any]]:
    cfg = shape["config"]
    llm = _engine(model_dir, "batch_invariant", plan,
                  max_model_len=max(plan.contexts) + plan.context_tokens + 16,
                  max_num_batched_tokens=8192 if torch.cuda.is_available() else 64)
    tpots = {}
    for ctx in plan.contexts:
        prompt = _prompts(1, [ctx], cfg["vocab_size"], seed=13 + ctx)
        tpots[ctx] = _tpot(llm, prompt, lora, plan.context_tokens, plan.trials)
    del llm
    _free()
    short, long = plan.contexts
    extra = (long - short) * full_kv_bytes_per_token(cfg)
    expected = tpots[short] + (extra / bandwidth if bandwidth else 0.0)
    return [{"model": name, "family": shape["family"], "level": "batch_invariant",
             "context": ctx, "tpot_ms": 1e3 * tpots[ctx],
             **({"extra_full_kv_bytes": extra, "expected_ms": 1e3 * expected,
                 "ratio": tpots[ctx] / expected} if ctx == long else {})}
            for ctx in plan.contexts]


def run(models: Sequence[str], sections: Sequence[str], *, smoke: bool = False,
        log: Callable[[str], None] = print,
        checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    from detlora import LoRARequest

    plan = Plan(smoke)
    shapes = {"smoke-gemma4": SMOKE} if smoke else {m: SHAPES[m] for m in models}
    rows: list[dict[str, Any]] = []
    long_rows: list[dict[str, Any]] = []
    bandwidth = _bandwidth()
    log(f"HBM copy bandwidth: {bandwidth / 1e12:.2f} TB/s" if bandwidth else
        "no GPU: no bandwidth, roofline not computed")
    for name, shape in shapes.items():
        with tempfile.TemporaryDirectory(prefix=f"detlora-{name}-") as tmp:
            t0 = time.perf_counter()
            model_dir = Path(tmp) / "model"
            weight_bytes = write_checkpoint(model_dir, shape["config"])
            adapter_bytes = write_adapter(Path(tmp) / "adapter", model_dir,
                                          targets=shape["adapter_targets"], rank=plan.rank)
            lora = LoRARequest("a", 1, str(Path(tmp) / "adapter"))
            log(f"{name}: {weight_bytes / 1e9:.2f} GB of weights written in "
                f"{time.perf_counter() - t0:.0f} s")
            by_level: dict[str, dict[str, Any]] = {}
            for level in LEVELS:
                row: dict[str, Any] = {"model": name, "family": shape["family"],
                                       "level": level}
                if "speed" in sections:
                    row = speed_row(name, shape, model_dir, lora, level, plan, bandwidth,
                                    adapter_bytes)
                if "invariance" in sections:
                    d, c, checks = invariance_checks(shape, model_dir, lora, level, plan,
                                                     thorough=level == "batch_invariant")
                    row |= {"differing": d, "comparisons": c, "checks": checks}
                by_level[level] = row
                rows.append(row)
                log(f"  {level}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float)
                                               else f"{k} {v}" for k, v in row.items()
                                               if k not in ("model", "family", "level")))
            fast, bi = by_level.get("fast", {}), by_level.get("batch_invariant", {})
            if "tpot_b1_ms" in fast and "tpot_b1_ms" in bi:
                bi["bi_vs_fast_b1"] = bi["tpot_b1_ms"] / fast["tpot_b1_ms"]
                bi["bi_vs_fast_b64"] = bi["batch_s_b64"] / fast["batch_s_b64"]
            if "long_context" in sections and shape["long_context"]:
                long_rows += long_context_rows(name, shape, model_dir, lora, plan, bandwidth)
                log(f"  long context: {long_rows[-1]}")
        if checkpoint is not None:
            checkpoint({"meta": {"partial": True}, "rows": rows, "long_context": long_rows})
    return {"meta": {"models": list(shapes), "sections": list(sections), "smoke": smoke,
                     "bandwidth_Bps": bandwidth,
                     "plan": {k: v for k, v in vars(plan).items()}},
            "rows": rows, "long_context": long_rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/architectures_gemma.json")
    parser.add_argument("--models", default=",".join(SHAPES),
                        help=f"shapes to run (comma-separated; {', '.join(SHAPES)})")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"what to measure (comma-separated; {', '.join(SECTIONS)})")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny Gemma 4 (CPU or GPU), every section, few tokens")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    sections = [s for s in args.sections.split(",") if s]
    unknown = [m for m in models if m not in SHAPES] + [s for s in sections
                                                         if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown model(s) or section(s) {unknown}")
    from benchmarks.harness import results_meta, write_results

    command = " ".join(["python -m benchmarks.suites.architectures_gemma",
                        *(argv if argv is not None else sys.argv[1:])])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def checkpoint(partial: dict[str, Any]) -> None:
        partial["meta"] = {**results_meta(command), **partial["meta"]}
        Path(args.out).with_suffix(".partial.json").write_text(json.dumps(partial, indent=1))

    result = run(models, sections, smoke=args.smoke, checkpoint=checkpoint)
    result["meta"] = {**results_meta(command), **result["meta"]}
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
