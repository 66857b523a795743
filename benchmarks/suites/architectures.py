"""Base architectures on the GPU: speed and bit-reproducibility of each registered shape.

Each shape in ``SHAPES`` (config.json and its adapters' target modules; other families add
theirs) is written with random bf16 weights (tensor names and shapes from transformers' own
model class, built on the meta device) and two rank-16 PEFT adapters (alpha 32, B not zero)
on every projection. Per level (``fast``, ``batch_invariant``) one engine measures TPOT at
batch 1, output tok/s at batch 64 and runs the engine suite's invariance checks
(``benchmarks.suites.engine``: repeat, cross_batch, arrival_order, mixed_adapters, and
preemption at batch_invariant), token ids and logprobs compared with ==.

    {"meta": {..., "plan", "models": {name: {"family", "weight_bytes", "step_bytes_b1",
              "copy_TBps", "engines", "throughput", "determinism"}}},
     "rows": [{"model", "family", "level", "tpot_b1_ms", "roofline_b1", "tok_s_b64",
               "bi_vs_fast_b1", "bi_vs_fast_b64", "differing", "comparisons"}]}

``roofline_b1`` = bytes a batch-1 decode step reads (every weight but the embedding table,
of which one row; one adapter's A and B; K and V at the mean context) / measured copy
bandwidth (read + write bytes of a device copy per second) / TPOT: the share of the memory
roofline reached. ``bi_vs_fast_bN`` = this level's TPOT at batch N / fast's. ``differing`` /
``comparisons`` sum the level's invariance checks.

    python -m benchmarks.suites.architectures [--models qwen2.5-7b,phi3.5-mini] [--smoke]
        [--out benchmarks/results/architectures.json]
        [--keep-rows-from FILE]   (rows of the models this run does not measure stay)

``--smoke`` runs every step on the CPU in fp32 on shapes cut down to a few layers and
narrow widths (the same code path; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.suites import architectures_gemma as gemma
from benchmarks.suites import engine as eng

LEVELS = ("fast", "batch_invariant")
SPLIT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _phi35_factors() -> dict[str, list[float]]:
    """LongRoPE factors of Phi-3.5-mini's length (head_dim 96: 48 each), drawn here: the
    weights are random, so only their shape matters (decode never passes the original
    context in this plan)."""
    g = torch.Generator().manual_seed(35)
    return {"short_factor": (1 + 2 * torch.rand(48, generator=g)).tolist(),
            "long_factor": (1 + 60 * torch.rand(48, generator=g)).tolist()}


@dataclass(frozen=True)
class Shape:
    """A registered model: its config.json, its family, its adapters' target_modules."""

    family: str
    config: dict[str, Any]
    targets: tuple[str, ...]


# name -> shape. Add an entry to measure another model; --models picks among them.
SHAPES: dict[str, Shape] = {
    "qwen2.5-7b": Shape("qwen2", {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28,
        "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16"}, SPLIT_TARGETS),
    "mistral-7b": Shape("mistral", {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}, SPLIT_TARGETS),
    "phi3.5-mini": Shape("phi3", {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_scaling": {"type": "longrope", **_phi35_factors()}, "rope_theta": 10000.0,
        "sliding_window": 262144, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000,
        "torch_dtype": "bfloat16"}, FUSED_TARGETS),
    # Gemma 4 E4B, Gemma 3 1B and 4B (their windows, the 32k-context TPOT and window-crossing
    # checks: benchmarks/suites/architectures_gemma.py).
    **{name: Shape(g["family"], g["config"], tuple(g["adapter_targets"]))
       for name, g in gemma.SHAPES.items()},
}


@dataclass(frozen=True)
class Plan:
    prompts: int = 64
    prompt_len: int = 100
    output_len: int = 64
    repetitions: int = 2
    cross_batches: tuple[int, ...] = (1, 16)
    batch1_prompts: int = 8
    throughput_batches: tuple[int, ...] = (1, 64)
    trials: int = 2
    rank: int = 16
    levels: tuple[str, ...] = LEVELS
    smoke: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def smoke_plan(cls) -> Plan:
        return cls(prompts=4, prompt_len=12, output_len=6, cross_batches=(1, 2),
                   batch1_prompts=2, throughput_batches=(1, 4), trials=1, rank=4, smoke=True,
                   engine_args={"device": "cpu", "max_num_seqs": 8,
                                "max_num_batched_tokens": 256})

    def bench_plan(self, vocab: int) -> eng.BenchPlan:
        """The engine suite's plan for its Workload and checks (its shape: vocab and rank)."""
        shape = replace(eng.ModelShape(), vocab=vocab, rank=self.rank, alpha=2 * self.rank)
        return replace(eng.BenchPlan(), shape=shape, prompts=self.prompts,
                       prompt_len=self.prompt_len, output_len=self.output_len,
                       repetitions=self.repetitions, cross_batches=self.cross_batches,
                       batch1_prompts=self.batch1_prompts,
                       throughput_batches=self.throughput_batches, trials=self.trials)


def smoke_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` cut down for the CPU: 2 layers, narrow widths (not powers of two), fp32."""
    small = dict(cfg, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, vocab_size=320,
                 torch_dtype="float32")
    small.pop("head_dim", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in small:
            small[key] = min(small[key], 319)
    if "layer_types" in small or "sliding_window_pattern" in small:  # Gemma: one of each
        small |= {"layer_types": ["sliding_attention", "full_attention"], "head_dim": 16,
                  "num_kv_shared_layers": 0, "sliding_window": 8}
        small.pop("sliding_window_pattern", None)
        if "global_head_dim" in small:
            small |= {"global_head_dim": 32, "hidden_size_per_layer_input": 8,
                      "vocab_size_per_layer_input": 320}
    rope = small.get("rope_scaling")
    if rope and rope.get("type", rope.get("rope_type")) == "longrope":
        small["rope_scaling"] = {**rope, "short_factor": rope["short_factor"][:8],
                                 "long_factor": rope["long_factor"][:8]}
    return small


# ----------------------------------------------------------------------------- assets


def _meta_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """transformers' model of ``cfg`` on the meta device: its tensor names and shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(cfg["model_type"], **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def write_model(path: Path, cfg: dict[str, Any], device: str, seed: int = 0) -> dict[str, int]:
    """Random weights of every tensor transformers' class holds (norm weights near 1, the
    rest N(0, 0.02)), in the config's dtype; returns {"weight_bytes", "embedding_bytes"}."""
    from safetensors.torch import save_file

    dtype = torch.float32 if cfg.get("torch_dtype") == "float32" else torch.bfloat16
    model = _meta_model(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        x = torch.randn(t.shape, generator=g, device=device, dtype=torch.float32)
        x = 1 + 0.05 * x if "norm" in name and name.endswith("weight") else 0.02 * x
        if name.endswith("layer_scalar"):  # Gemma 4 scales the residual stream by it
            x = torch.ones_like(x)
        tensors[name] = x.to(dtype).cpu().contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    embed = next(t for n, t in tensors.items() if n.endswith("embed_tokens.weight"))
    return {"weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "embedding_bytes": embed.numel() * embed.element_size()}


def write_adapter(path: Path, cfg: dict[str, Any], targets: Sequence[str], rank: int,
                  seed: int) -> int:
    """A PEFT adapter of rank ``rank`` on every module named in ``targets``; its bytes."""
    from safetensors.torch import save_file

    dtype = torch.float32 if cfg.get("torch_dtype") == "float32" else torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in _meta_model(cfg).named_modules():
        if name.rsplit(".", 1)[-1] not in targets or not hasattr(module, "in_features"):
            continue
        fin, fout = module.in_features, module.out_features
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fin, generator=g)
                                           / fin**0.5).to(dtype)
        tensors[f"{key}.lora_B.weight"] = (torch.randn(fout, rank, generator=g) * 0.02).to(
            dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    elem = 4 if cfg.get("torch_dtype") == "float32" else 2
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * elem


def copy_bandwidth_tbps(device: str, nbytes: int) -> float:
    """Read + write bytes per second of a device copy (median), in TB/s."""
    if device == "cuda":
        return eng.copy_bandwidth_tbps(nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e12


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
    step_bytes = (sizes["weight_bytes"] - sizes["embedding_bytes"]
                  + sizes["embedding_bytes"] // cfg["vocab_size"] + adapter_bytes[0]
                  + int(kv_bytes_per_token(cfg) * context))
    if shape.family in ("gemma3", "gemma4"):  # tied head, per-layer embeddings, windows
        step_bytes = gemma.decode_bytes(cfg, int(context), adapter_bytes[0])
    tbps = copy_bandwidth_tbps(device, 2**30 if device == "cuda" else 2**26)
    log(f"{name}: wrote {sizes['weight_bytes'] / 1e9:.2f} GB and adapters in "
        f"{time.perf_counter() - started:.0f} s; {tbps:.2f} TB/s copy, batch-1 floor "
        f"{1e3 * step_bytes / (tbps * 1e12):.3f} ms")
    bench = plan.bench_plan(cfg["vocab_size"])
    work = eng.Workload(bench, loras)
    details: dict[str, Any] = {"family": shape.family, **sizes, "adapter_bytes": adapter_bytes[0],
                               "step_bytes_b1": step_bytes, "copy_TBps": tbps, "engines": {},
                               "throughput": [], "determinism": []}
    tpot: dict[tuple[str, int], float] = {}
    toks: dict[str, float] = {}
    for level in plan.levels:
        t0 = time.perf_counter()
        llm = eng.make_engine(root / "model", level, bench, **plan.engine_args)
        details["engines"][level] = {"init_s": round(time.perf_counter() - t0, 1),
                                     "cuda_graphs": llm.engine.runner.uses_cuda_graphs,
                                     "backend": llm.engine.backend.describe()}
        rows = eng.throughput_rows(llm, level, work, log)
        details["throughput"] += rows
        for r in rows:
            tpot[(level, r["batch"])] = r["tpot_ms"]
            toks[f"{level}_{r['batch']}"] = r["output_tok_per_s"]
        checks, ref = eng._determinism(llm, level, work, log)
        del llm
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


def keep_rows_from(result: dict[str, Any], earlier: Path) -> dict[str, Any]:
    """``result`` with an earlier file's rows (and details) of the models not measured now:
    runs split over several GPU jobs, or families added one by one, make one file."""
    if not earlier.is_file():
        return result
    old = json.loads(earlier.read_text())
    measured = {r["model"] for r in result["rows"]}
    kept = [r for r in old.get("rows", []) if r.get("model") not in measured]
    old_models = old.get("meta", {}).get("models", {})
    for name in {r["model"] for r in kept}:
        if name in old_models:
            result["meta"]["models"].setdefault(name, {**old_models[name],
                                                       "from_earlier_run": old["meta"].get(
                                                           "commit")})
    result["rows"] = kept + result["rows"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES),
                        help=f"comma-separated, among: {', '.join(SHAPES)}")
    parser.add_argument("--smoke", action="store_true",
                        help="the CPU, fp32, cut-down shapes: checks the code path only")
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

    command = " ".join(["python -m benchmarks.suites.architectures",
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
