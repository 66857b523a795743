"""Hybrid architectures on the GPU: the Nemotron-3-Nano-4B shape's speed and bits.

Rows in the schema of the architectures benchmark (``benchmarks/suites/architectures.py``,
whose helpers it shares; hybrids have a roofline, prompts and checks of their own, so they
are measured here), into the same file (``--keep-rows-from`` keeps the other models' rows):

    {"meta": {..., "plan", "models": {name: {"family", "weight_bytes", "step_bytes_b1",
              "state_bytes_per_seq", "copy_TBps", "engines", "throughput", "determinism"}}},
     "rows": [{"model", "family", "level", "tpot_b1_ms", "roofline_b1", "tok_s_b64",
               "bi_vs_fast_b1", "bi_vs_fast_b64", "differing", "comparisons"}]}

The shape (``SHAPES``) is written with random bf16 weights (tensor names and shapes from
transformers' NemotronH class on the meta device) and two rank-16 PEFT adapters (alpha 32, B
not zero) on q/k/v/o, up/down and the Mamba in_proj. Prompts of 200 tokens and 100 output
tokens, so decoding closes a 256-position chunk. Per level (``fast``, ``batch_invariant``) one
engine measures TPOT at batch 1 and output tok/s at batch 64 and runs the engine suite's
checks (repeat, cross_batch, arrival_order, mixed_adapters; preemption at batch_invariant)
plus two of its own: ``chunked_prefill`` (prompts cut at a 96-token budget, off the chunk
grid) and ``decode_vs_prefill`` (prompt + its first 60 output tokens as a prompt: the rest
must be the same bits), token ids and logprobs compared with ==.

Roofline: ``roofline_b1`` = the bytes a batch-1 decode step must move / copy bandwidth /
TPOT, counting every weight but the embedding table (one row of it), one adapter's A and B,
K and V of the attention layers at the mean context, and each Mamba layer's state read and
written once (the fp32 SSM state and the conv state: ``state_bytes_per_seq``). What detlora's
decode moves instead (the SSM state read, the open chunk's rows read, one row written) is
recorded beside it as ``impl_state_bytes_per_seq``.

    python -m benchmarks.suites.architectures_nemotron [--smoke]
        [--out benchmarks/results/architectures.json] [--keep-rows-from FILE]

``--smoke`` runs every step on the CPU in fp32 on a cut-down hybrid (the same code path; its
numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.suites import engine as eng
from benchmarks.suites.architectures import (
    LEVELS,
    Shape,
    copy_bandwidth_tbps,
    keep_rows_from,
    write_adapter,
)

NEMOTRON_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "in_proj")


# name -> shape (architectures.py's Shape: family, config.json, adapter targets).
SHAPES: dict[str, Shape] = {
    # NVIDIA-Nemotron-3-Nano-4B-BF16 (Megatron-Bridge's nemotron_3_nano_4b recipe).
    "nemotron-3-nano-4b": Shape("nemotron_h", {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hidden_size": 3136, "hybrid_override_pattern":
            "M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-",
        "num_hidden_layers": 42, "num_attention_heads": 40, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12544, "mlp_hidden_act": "relu2",
        "mamba_num_heads": 96, "mamba_head_dim": 80, "ssm_state_size": 128, "n_groups": 8,
        "conv_kernel": 4, "use_conv_bias": True, "chunk_size": 256, "mamba_hidden_act": "silu",
        "time_step_limit": [0.0, float("inf")], "use_bias": False, "mlp_bias": False,
        "attention_bias": False, "layer_norm_epsilon": 1e-5, "vocab_size": 131072,
        "tie_word_embeddings": False, "max_position_embeddings": 262144,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "torch_dtype": "bfloat16"}, NEMOTRON_TARGETS),
}


@dataclass(frozen=True)
class Plan:
    prompts: int = 64
    prompt_len: int = 200
    output_len: int = 100
    repetitions: int = 2
    cross_batches: tuple[int, ...] = (1, 16)
    batch1_prompts: int = 8
    throughput_batches: tuple[int, ...] = (1, 64)
    trials: int = 2
    rank: int = 16
    chunk_budget: int = 96  # max_num_batched_tokens of the chunked_prefill check
    replay_tokens: int = 60  # decode_vs_prefill: output tokens prefilled again
    levels: tuple[str, ...] = LEVELS
    smoke: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def smoke_plan(cls) -> Plan:
        return cls(prompts=4, prompt_len=20, output_len=12, cross_batches=(1, 2),
                   batch1_prompts=2, throughput_batches=(1, 4), trials=1, rank=4,
                   chunk_budget=7, replay_tokens=5, smoke=True,
                   engine_args={"device": "cpu", "max_num_seqs": 8,
                                "max_num_batched_tokens": 256})

    def bench_plan(self, vocab: int) -> eng.BenchPlan:
        shape = replace(eng.ModelShape(), vocab=vocab, rank=self.rank, alpha=2 * self.rank)
        return replace(eng.BenchPlan(), shape=shape, prompts=self.prompts,
                       prompt_len=self.prompt_len, output_len=self.output_len,
                       repetitions=self.repetitions, cross_batches=self.cross_batches,
                       batch1_prompts=self.batch1_prompts,
                       throughput_batches=self.throughput_batches, trials=self.trials)


def smoke_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` cut down for the CPU: 6 layers of every kind, narrow widths (not powers of
    two), a chunk of 16 positions, fp32."""
    return dict(cfg, hidden_size=96, hybrid_override_pattern="M-M*-M", num_hidden_layers=6,
                num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                intermediate_size=200, mamba_num_heads=6, mamba_head_dim=12, ssm_state_size=16,
                n_groups=2, chunk_size=16, vocab_size=320, bos_token_id=1, eos_token_id=2,
                torch_dtype="float32")


# ----------------------------------------------------------------------------- assets


def _meta_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """transformers' model of ``cfg`` on the meta device: its tensor names and shapes."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(cfg["model_type"], **fields)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")  # use_mamba_kernels and kernel fallbacks
        return AutoModelForCausalLM.from_config(config)


def write_model(path: Path, cfg: dict[str, Any], device: str, seed: int = 0) -> dict[str, int]:
    """Random weights of every tensor transformers' class holds (norm weights near 1, the
    rest N(0, 0.02)), in the config's dtype; returns {"weight_bytes", "embedding_bytes"}."""
    from safetensors.torch import save_file

    dtype = torch.float32 if cfg.get("torch_dtype") == "float32" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in _meta_model(cfg).state_dict().items():
        x = torch.randn(t.shape, generator=g, device=device, dtype=torch.float32)
        x = 1 + 0.05 * x if "norm" in name and name.endswith("weight") else 0.02 * x
        tensors[name] = x.to(dtype).cpu().contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    embed = next(t for n, t in tensors.items() if n.endswith("embeddings.weight"))
    return {"weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "embedding_bytes": embed.numel() * embed.element_size()}


def _pattern(cfg: dict[str, Any]) -> str:
    return cfg["hybrid_override_pattern"]


def kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    """K and V of one token over the attention (``*``) layers only."""
    elem = 4 if cfg.get("torch_dtype") == "float32" else 2
    return (2 * _pattern(cfg).count("*") * cfg["num_key_value_heads"] * cfg["head_dim"]
            * elem)


def state_bytes_per_seq(cfg: dict[str, Any]) -> dict[str, int]:
    """Bytes one sequence's decode step moves in the Mamba layers' state:

    ``roofline``: the fp32 SSM state [H, P, N] and the conv state [K - 1, conv_dim] read and
    written once per layer (what a recurrent decode must touch);
    ``detlora``: what detlora's exact-replay decode moves on average (the SSM state read, the
    open chunk's x and B rows read, at half a chunk on average, its new row written, the conv
    state read and written; the state written at a chunk's end once per chunk)."""
    elem = 4 if cfg.get("torch_dtype") == "float32" else 2
    layers = _pattern(cfg).count("M")
    h, p, n, g = (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"],
                  cfg["n_groups"])
    d_inner, conv_dim, cs = h * p, h * p + 2 * g * n, cfg["chunk_size"]
    ssm = h * p * n * 4
    conv = (cfg.get("conv_kernel", 4) - 1) * conv_dim * elem
    rows = cs / 2 * (d_inner + g * n + h) * elem
    detlora = ssm + ssm / cs + rows + (conv_dim + h) * elem + 2 * conv
    return {"roofline": layers * (2 * ssm + 2 * conv), "detlora": int(layers * detlora)}


# ----------------------------------------------------------------------------- checks


def _hybrid_checks(model_dir: Path, level: str, w: eng.Workload, ref: list[Any], plan: Plan,
                   log: Callable[[str], None]) -> list[dict[str, Any]]:
    """``chunked_prefill`` (a budget off the chunk grid) and ``decode_vs_prefill``."""
    rows: list[dict[str, Any]] = []
    bench = w.plan
    idx = list(range(bench.prompts))
    small = eng.make_engine(model_dir, level, bench,
                            **{**plan.engine_args, "max_num_batched_tokens": plan.chunk_budget})
    got = w.generate(small, idx)
    eng._row(rows, log, level, "chunked_prefill", len(idx), eng.count_differing(got, ref),
             max_num_batched_tokens=plan.chunk_budget)
    k = plan.replay_tokens
    prompts = [w.prompts[i] + ref[i].outputs[0].token_ids[:k] for i in idx]
    params = [replace(w.params[i], max_tokens=bench.output_len - k) for i in idx]
    again = small.generate(prompts, params, [w.loras[0]] * len(idx) if w.loras else None,
                           use_tqdm=False)
    differing = sum(a.outputs[0].token_ids != r.outputs[0].token_ids[k:]
                    or a.outputs[0].logprobs != r.outputs[0].logprobs[k:]
                    for a, r in zip(again, ref, strict=True))
    eng._row(rows, log, level, "decode_vs_prefill", len(idx), differing, prefilled_outputs=k)
    return rows


# ----------------------------------------------------------------------------- measuring


def measure(name: str, shape: Shape, plan: Plan, root: Path,
            log: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every level of one shape: its rows and its details."""
    from detlora import LoRARequest

    cfg = smoke_config(shape.config) if plan.smoke else shape.config
    device = "cpu" if plan.smoke else "cuda"
    started = time.perf_counter()
    sizes = write_model(root / "model", cfg, device)
    adapter_bytes = [write_adapter(root / f"adapter{k}", cfg, shape.targets, plan.rank, 10 + k)
                     for k in range(2)]
    loras = [LoRARequest(f"a{k}", k + 1, str(root / f"adapter{k}")) for k in range(2)]
    context = plan.prompt_len + plan.output_len / 2
    state = state_bytes_per_seq(cfg)
    step_bytes = (sizes["weight_bytes"] - sizes["embedding_bytes"]
                  + sizes["embedding_bytes"] // cfg["vocab_size"] + adapter_bytes[0]
                  + int(kv_bytes_per_token(cfg) * context) + state["roofline"])
    tbps = copy_bandwidth_tbps(device, 2**30 if device == "cuda" else 2**26)
    log(f"{name}: wrote {sizes['weight_bytes'] / 1e9:.2f} GB and adapters in "
        f"{time.perf_counter() - started:.0f} s; {tbps:.2f} TB/s copy, batch-1 floor "
        f"{1e3 * step_bytes / (tbps * 1e12):.3f} ms (state {state['roofline'] / 1e6:.0f} MB)")
    bench = plan.bench_plan(cfg["vocab_size"])
    work = eng.Workload(bench, loras)
    details: dict[str, Any] = {
        "family": shape.family, **sizes, "adapter_bytes": adapter_bytes[0],
        "step_bytes_b1": step_bytes, "state_bytes_per_seq": state["roofline"],
        "impl_state_bytes_per_seq": state["detlora"], "copy_TBps": tbps, "engines": {},
        "throughput": [], "determinism": []}
    tpot: dict[tuple[str, int], float] = {}
    toks: dict[str, float] = {}
    for level in plan.levels:
        t0 = time.perf_counter()
        llm = eng.make_engine(root / "model", level, bench, **plan.engine_args)
        details["engines"][level] = {"init_s": round(time.perf_counter() - t0, 1),
                                     "cuda_graphs": llm.engine.runner.uses_cuda_graphs,
                                     "num_kv_blocks": llm.engine.num_kv_blocks,
                                     "backend": llm.engine.backend.describe()}
        rows = eng.throughput_rows(llm, level, work, log)
        details["throughput"] += rows
        for r in rows:
            tpot[(level, r["batch"])] = r["tpot_ms"]
            toks[f"{level}_{r['batch']}"] = r["output_tok_per_s"]
        checks, ref = eng._determinism(llm, level, work, log)
        del llm
        _free(device)
        checks += _hybrid_checks(root / "model", level, work, ref, plan, log)
        _free(device)
        if level == "batch_invariant":
            checks += eng._preemption(root / "model", level, work, ref, log)
            _free(device)
        details["determinism"] += checks
    rows_out = []
    big = max(plan.throughput_batches)
    for level in plan.levels:
        checks = [c for c in details["determinism"] if c["mode"] == level]
        t1 = tpot.get((level, 1))

        def vs_fast(batch: int, level: str = level) -> float | None:
            mine, fast = tpot.get((level, batch)), tpot.get(("fast", batch))
            return None if mine is None or not fast else mine / fast

        rows_out.append({
            "model": name, "family": shape.family, "level": level, "tpot_b1_ms": t1,
            "roofline_b1": None if not t1 else step_bytes / (tbps * 1e12) / (t1 / 1e3),
            "tok_s_b64": toks.get(f"{level}_{big}") if big == 64 else None,
            "bi_vs_fast_b1": vs_fast(1), "bi_vs_fast_b64": vs_fast(64),
            "differing": sum(c["differing"] for c in checks),
            "comparisons": sum(c["comparisons"] for c in checks)})
        log(f"  {name} {level}: {rows_out[-1]}")
    details["seconds"] = round(time.perf_counter() - started, 1)
    return rows_out, details


def _free(device: str) -> None:
    if device == "cuda":
        eng.free_gpu()


def run(models: Sequence[str], plan: Plan, log: Callable[[str], None] = print,
        checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    if not plan.smoke and not torch.cuda.is_available():
        raise RuntimeError("the architectures benchmark needs a CUDA GPU (or --smoke)")
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    for name in models:
        with tempfile.TemporaryDirectory(prefix=f"detlora-arch-{name}-") as tmp:
            model_rows, details[name] = measure(name, SHAPES[name], plan, Path(tmp), log)
        rows += model_rows
        if checkpoint is not None:
            checkpoint({"meta": {"models": details, "partial": True}, "rows": rows})
    plan_meta = {k: v for k, v in asdict(plan).items() if k != "engine_args"}
    return {"meta": {"plan": plan_meta, "models": details}, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES),
                        help=f"comma-separated, among: {', '.join(SHAPES)}")
    parser.add_argument("--smoke", action="store_true",
                        help="the CPU, fp32, a cut-down hybrid: checks the code path only")
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--out", default="benchmarks/results/architectures.json")
    parser.add_argument("--keep-rows-from", default=None, metavar="FILE",
                        help="keep this file's rows of the models not measured now")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in SHAPES]
    if unknown or not models:
        parser.error(f"unknown model(s) {unknown}; choose from {list(SHAPES)}")
    levels = tuple(x for x in args.levels.split(",") if x)
    if "fast" not in levels or any(x not in eng.MODES for x in levels):
        parser.error(f"--levels must include fast (the baseline), among {list(eng.MODES)}")
    plan = replace(Plan.smoke_plan() if args.smoke else Plan(), levels=levels)
    from benchmarks.harness import results_meta, write_results

    command = " ".join(["python -m benchmarks.suites.architectures_nemotron",
                        *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def checkpoint(partial: dict[str, Any]) -> None:
        partial["meta"] = {**results_meta(command), **partial["meta"]}
        out.with_suffix(".partial.json").write_text(json.dumps(partial, indent=1))

    result = run(models, plan, checkpoint=checkpoint)
    result["meta"] = {**results_meta(command), **result["meta"]}
    if args.keep_rows_from:
        result = keep_rows_from(result, Path(args.keep_rows_from))
    write_results(out, result)
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
