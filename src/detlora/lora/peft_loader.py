"""Read a PEFT LoRA adapter directory and check it against the base model.

Supported: ``adapter_config.json`` + ``adapter_model.safetensors``; targets among q/k/v/o and
gate/up/down projections (any subset, any layers: untargeted modules get no update);
``lora_alpha / r`` scaling, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; per-module
ranks and alphas through ``rank_pattern`` / ``alpha_pattern`` (matched as PEFT matches them);
``layers_to_transform``. Everything else that changes the forward pass is refused with a
ValueError that names it, rather than silently computing something PEFT would not.
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

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

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
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def load_peft_adapter(
    path: str | Path, target_shapes: Mapping[str, tuple[int, int]], max_rank: int
) -> LoRAAdapter:
    """Load and check an adapter. ``target_shapes`` maps every module the base model allows
    as a target to its (in_features, out_features); ``max_rank`` is the engine's limit."""
    path = Path(path)
    cfg = _read_config(path)
    _check_config(cfg, path)
    weights = _read_weights(path)
    where = f"{path / WEIGHTS_FILE}"

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in weights.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B weight "
                             "(DoRA magnitudes, embeddings or biases are not supported)")
        module, ab = m["module"], m["ab"]
        if module not in target_shapes and f"model.{module}" in target_shapes:
            module = f"model.{module}"  # trained on the bare decoder (LlamaModel), no LM head
        if module not in target_shapes:
            raise ValueError(f"{where}: tensor {key!r} targets {module!r}, which is not a "
                             f"supported LoRA target of this model (supported: "
                             f"{', '.join(SUPPORTED_TARGETS)} in each decoder layer)")
        if ab in pairs.setdefault(module, {}):
            raise ValueError(f"{where}: lora_{ab} of {module!r} appears twice")
        pairs[module][ab] = t
    if not pairs:
        raise ValueError(f"{where} holds no LoRA weights")

    r_default = cfg["r"]
    alpha_default = cfg["lora_alpha"]
    rank_pattern: Mapping[str, Any] = cfg.get("rank_pattern") or {}
    alpha_pattern: Mapping[str, Any] = cfg.get("alpha_pattern") or {}
    modules: dict[str, LoRAModuleWeights] = {}
    for module in sorted(pairs):
        ab = pairs[module]
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"{where}: {module!r} has no {missing} weight")
        if not _targeted(module, cfg):
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
        key = _pattern_key([*rank_pattern, *alpha_pattern], module)
        r_cfg = rank_pattern.get(key, r_default)
        alpha = alpha_pattern.get(key, alpha_default)
        if rank != r_cfg:
            raise ValueError(f"{where}: {module!r} has rank {rank} but adapter_config.json "
                             f"says r={r_cfg}")
        if rank > max_rank:
            raise ValueError(f"{path}: {module!r} has rank {rank}, above max_lora_rank "
                             f"{max_rank} (raise max_lora_rank)")
        scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        modules[module] = LoRAModuleWeights(a=a, b=b, scale=float(scale))
    frozen = MappingProxyType(modules)
    return LoRAAdapter(path=str(path), modules=frozen, hash=adapter_hash(frozen))


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
    for field in ("r", "lora_alpha"):
        v = cfg.get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{src}: {field} must be a positive number, got {v!r}")
    if not isinstance(cfg["r"], int):
        raise ValueError(f"{src}: r must be an integer, got {cfg['r']!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = cfg.get(field) or {}
        if not isinstance(pattern, dict) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
            for v in pattern.values()
        ):
            raise ValueError(f"{src}: {field} must map module patterns to positive numbers, "
                             f"got {pattern!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets
                   if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS]
        if unknown:
            raise ValueError(f"{src}: target_modules {unknown} are not supported "
                             f"(supported: {', '.join(SUPPORTED_TARGETS)})")
    elif not isinstance(targets, str):
        raise ValueError(f"{src}: target_modules must be a list or a string, got {targets!r}")
    layers = cfg.get("layers_to_transform")
    if layers is not None and not isinstance(layers, (int, list)):
        raise ValueError(f"{src}: layers_to_transform must be an int or a list, got {layers!r}")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS_FILE
    if file.is_file():
        try:
            return load_file(str(file), device="cpu")
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
    if (path / "adapter_model.bin").is_file():
        raise ValueError(f"{path} holds adapter_model.bin (a pickle): detlora loads "
                         f"{WEIGHTS_FILE} only; re-save the adapter with "
                         "save_pretrained(..., safe_serialization=True)")
    raise FileNotFoundError(f"{file} is missing")


def _targeted(module: str, cfg: Mapping[str, Any]) -> bool:
    """Whether PEFT would have put LoRA on ``module`` under this config."""
    targets = cfg["target_modules"]
    if isinstance(targets, str):
        ok = targets == "all-linear" or re.fullmatch(targets, module) is not None
    else:
        ok = any(module == t or module.endswith("." + t) for t in targets)
    layers = cfg.get("layers_to_transform")
    if ok and layers is not None:
        wanted = {layers} if isinstance(layers, int) else set(layers)
        m = _LAYER.search(module)
        ok = m is not None and int(m.group(1)) in wanted
    return ok


def _pattern_key(keys: list[str], module: str) -> str | None:
    """PEFT's rule: the first pattern key that matches the end of the module name."""
    for key in keys:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None
