"""Read a PEFT LoRA adapter directory and check it against the base model.

Supported: ``adapter_config.json`` + ``adapter_model.safetensors``; targets among q/k/v/o and
gate/up/down projections (any subset, any layers: untargeted modules get no update), the
Mamba-2 in_proj/out_proj of hybrid models, and the fused modules of models whose HF layout
fuses them (Phi-3's qkv_proj, gate_up_proj: one A and one B spanning the slices, returned as
one module per slice with B's rows split and A shared, which computes the same update);
``lora_alpha / r`` scaling, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; per-module
ranks and alphas through ``rank_pattern`` / ``alpha_pattern``; ``layers_to_transform`` and
``layers_pattern`` (patterns matched as PEFT matches them, at a bounded cost:
``detlora.lora.patterns``). Everything else that changes the forward pass is refused with a
ValueError that names it, rather than silently computing something PEFT would not; so are
numbers that are not finite or out of range, and weights holding NaN or inf (the format has
no checksum: corrupt bytes often decode to them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from detlora.json_files import read_json_object
from detlora.lora.adapter import LoRAAdapter, LoRAModuleWeights
from detlora.lora.hashing import adapter_hash
from detlora.lora.patterns import check_pattern, check_pattern_keys, match_modules
from detlora.models.finite_weights import check_finite

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "qkv_proj", "gate_up_proj", "in_proj", "out_proj",
                     # Gemma 4's per-layer-embedding linears (models/gemma4.py)
                     "per_layer_input_gate", "per_layer_projection",
                     "per_layer_model_projection")

# adapter_config.json fields whose non-empty values change the forward pass in ways the
# engine does not implement: field -> what to tell the user.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "lora_bias": "lora_bias (a bias on lora_B) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) is not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "target_parameters": "target_parameters (LoRA on parameters) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "use_bdlora": "BD-LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "kasa_config is not supported",
    "velora_config": "velora_config is not supported",
    "monteclora_config": "monteclora_config is not supported",
    "megatron_config": "megatron_config is not supported",
}
# module name in the base model <- key in adapter_model.safetensors
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
MAX_RANK_VALUE = 1 << 16  # no LoRA rank is larger than a model's width


def load_peft_adapter(
    path: str | Path, target_shapes: Mapping[str, tuple[int, int]], max_rank: int,
    fused: Mapping[str, tuple[str, ...]] | None = None,
) -> LoRAAdapter:
    """Load and check an adapter. ``target_shapes`` maps every module the base model allows
    as a target to its (in_features, out_features); ``max_rank`` is the engine's limit;
    ``fused`` maps a fused module's name to its slices' names (``lora_fused_targets``)."""
    path = Path(path)
    cfg = _read_config(path)
    _check_config(cfg, path)
    weights = _read_weights(path)
    where = f"{path / WEIGHTS_FILE}"

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    origin: dict[str, str] = {}  # module -> its name in the adapter (what patterns match)
    for key, t in weights.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B weight "
                             "(DoRA magnitudes, embeddings or biases are not supported)")
        module, ab = m["module"], m["ab"]
        if module.startswith("backbone."):  # NemotronH's own spelling of the stack
            module = "model." + module[len("backbone."):]
        if module not in target_shapes and f"model.{module}" in target_shapes:
            module = f"model.{module}"  # trained on the bare decoder (LlamaModel), no LM head
        module = _text_tower_name(module, target_shapes)
        refused = getattr(target_shapes, "refused", {})
        if module in refused:
            raise ValueError(f"{where}: tensor {key!r} targets {module!r}: {refused[module]}")
        if module not in target_shapes:
            names = [t for t in SUPPORTED_TARGETS
                     if any(n.endswith(f".{t}") for n in target_shapes)]
            raise ValueError(f"{where}: tensor {key!r} targets {module!r}, which is not a "
                             f"supported LoRA target of this model (supported: "
                             f"{', '.join(names)} in each decoder layer)")
        if ab in pairs.setdefault(module, {}):
            raise ValueError(f"{where}: lora_{ab} of {module!r} appears twice")
        pairs[module][ab] = t
        origin[module] = m["module"]
    if not pairs:
        raise ValueError(f"{where} holds no LoRA weights")

    r_default = cfg["r"]
    alpha_default = cfg["lora_alpha"]
    rank_pattern: Mapping[str, Any] = cfg.get("rank_pattern") or {}
    alpha_pattern: Mapping[str, Any] = cfg.get("alpha_pattern") or {}
    matches = match_modules(cfg, sorted(set(origin.values())), path / CONFIG_FILE)
    modules: dict[str, LoRAModuleWeights] = {}
    for module in sorted(pairs):
        ab = pairs[module]
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"{where}: {module!r} has no {missing} weight")
        match = matches[origin[module]]
        if not match.targeted:
            raise ValueError(f"{where}: {module!r} has weights but adapter_config.json does not "
                             "target it (target_modules / layers_to_transform)")
        a, b = ab["A"], ab["B"]
        in_f, out_f = target_shapes[module]
        rank = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or a.shape[1] != in_f or tuple(b.shape) != (out_f, rank):
            raise ValueError(
                f"{where}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"the base model needs [r, {in_f}] and [{out_f}, r] (adapter for another model?)"
            )
        r_cfg = rank_pattern.get(match.rank_key, r_default)
        alpha = alpha_pattern.get(match.alpha_key, alpha_default)
        if rank != r_cfg:
            raise ValueError(f"{where}: {module!r} has rank {rank} but adapter_config.json "
                             f"says r={r_cfg}")
        if rank > max_rank:
            raise ValueError(f"{path}: {module!r} has rank {rank}, above max_lora_rank "
                             f"{max_rank} (raise max_lora_rank)")
        scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        modules[module] = LoRAModuleWeights(a=a, b=b, scale=float(scale))
    digest = adapter_hash(modules)  # of the tensors as stored
    if fused:
        modules = _split_fused(modules, fused, target_shapes, where)
    return LoRAAdapter(path=str(path), modules=MappingProxyType(modules), hash=digest)


def _split_fused(modules: Mapping[str, LoRAModuleWeights], fused: Mapping[str, tuple[str, ...]],
                 target_shapes: Mapping[str, tuple[int, int]],
                 where: str) -> dict[str, LoRAModuleWeights]:
    """Each fused module as its slices: y_s += scale * (x A^T) B_s^T with B_s the slice's rows
    of B, which is the fused update cut along its output axis."""
    out = {name: m for name, m in modules.items() if name not in fused}
    for name, m in modules.items():
        if name not in fused:
            continue
        parts = fused[name]
        both = [part for part in parts if part in modules]
        if both:
            raise ValueError(f"{where}: {name!r} and its slice {both[0]!r} are both targeted "
                             "(an adapter targets the fused module or its slices, not both)")
        start = 0
        for part in parts:
            rows = target_shapes[part][1]
            out[part] = LoRAModuleWeights(a=m.a, b=m.b[start:start + rows], scale=m.scale)
            start += rows
    return out


# A multimodal checkpoint's text tower and the same text model on its own (Gemma): PEFT names
# its modules under one prefix or the other.
_TOWER, _TEXT = "model.language_model.", "model."


def _text_tower_name(module: str, target_shapes: Mapping[str, Any]) -> str:
    """``module`` under the prefix the model uses, when the adapter was trained on the
    other form of the same text model (multimodal text tower vs text-only)."""
    if module in target_shapes:
        return module
    if module.startswith(_TOWER):
        other = _TEXT + module[len(_TOWER):]
    elif module.startswith(_TEXT):
        other = _TOWER + module[len(_TEXT):]
    else:
        return module
    return other if other in target_shapes else module


def _read_config(path: Path) -> dict[str, Any]:
    return read_json_object(path, CONFIG_FILE, "adapter", "a PEFT adapter")


def _check_config(cfg: Mapping[str, Any], path: Path) -> None:
    src = path / CONFIG_FILE
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{src}: peft_type {peft_type!r} is not supported (only LORA)")
    for field, message in _UNSUPPORTED.items():
        if cfg.get(field):
            raise ValueError(f"{src}: {message} ({field}={cfg[field]!r})")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{src}: bias={bias!r} is not supported (only 'none')")
    if not _is_rank(cfg.get("r")):
        raise ValueError(f"{src}: r must be a positive integer (at most {MAX_RANK_VALUE}), "
                         f"got {_show(cfg.get('r'))}")
    if not _is_finite_positive(cfg.get("lora_alpha")):
        raise ValueError(f"{src}: lora_alpha must be a finite positive number, "
                         f"got {_show(cfg.get('lora_alpha'))}")
    rslora = cfg.get("use_rslora")
    if rslora is not None and not isinstance(rslora, bool):
        raise ValueError(f"{src}: use_rslora must be true or false, got {rslora!r}")
    for field, ok, what in (
        ("rank_pattern", _is_rank, f"a positive integer (at most {MAX_RANK_VALUE})"),
        ("alpha_pattern", _is_finite_positive, "a finite positive number"),
    ):
        pattern = cfg.get(field) or {}
        check_pattern_keys(field, pattern, src)
        for key, v in pattern.items():
            if not ok(v):
                raise ValueError(f"{src}: {field}[{key!r}] must be {what}, got {_show(v)}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets
                   if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS]
        if unknown:
            raise ValueError(f"{src}: target_modules {unknown} are not supported "
                             f"(supported: {', '.join(SUPPORTED_TARGETS)})")
    elif isinstance(targets, str):
        check_pattern("target_modules", targets, src)
    else:
        raise ValueError(f"{src}: target_modules must be a list or a string, got {targets!r}")
    layers = cfg.get("layers_to_transform")
    if layers is not None and not (_is_index(layers) or (
            isinstance(layers, list) and all(_is_index(i) for i in layers))):
        raise ValueError(f"{src}: layers_to_transform must be a layer index or a list of "
                         f"them (integers >= 0), got {_show(layers)}")
    pattern = cfg.get("layers_pattern")
    if pattern:
        for p in [pattern] if isinstance(pattern, str) else pattern if isinstance(
                pattern, list) else [pattern]:
            check_pattern("layers_pattern", p, src)
    # PEFT's LoraConfig refuses these combinations.
    if isinstance(targets, str) and (layers is not None or pattern is not None):
        raise ValueError(f"{src}: layers_to_transform and layers_pattern cannot be used when "
                         "target_modules is a string (a regular expression)")
    if pattern and layers is None:
        raise ValueError(f"{src}: layers_pattern needs layers_to_transform")


def _is_rank(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_RANK_VALUE


def _is_index(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_finite_positive(v: object) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v)) and v > 0
    except OverflowError:  # an int beyond any float
        return False


def _show(v: object, limit: int = 40) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS_FILE
    if file.is_file():
        try:
            tensors = load_file(str(file), device="cpu")
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
        for key, t in tensors.items():
            check_finite(t, f"{file}: tensor {key!r}")
        return tensors
    if (path / "adapter_model.bin").is_file():
        raise ValueError(f"{path} holds adapter_model.bin (a pickle): detlora loads "
                         f"{WEIGHTS_FILE} only; re-save the adapter with "
                         "save_pretrained(..., safe_serialization=True)")
    raise FileNotFoundError(f"{file} is missing")
