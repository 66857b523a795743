"""Hybrid (Mamba-2 + attention + MLP) models: their layer pattern and state-space sizes, read
from a Nemotron-H ``config.json`` and checked field by field.

Nemotron-H names each layer by one character (``hybrid_override_pattern``; transformers 5.x
writes the list ``layers_block_type`` instead): ``M`` a Mamba-2 mixer, ``*`` attention
(without any position embedding), ``-`` a squared-ReLU MLP, ``E`` a mixture of experts
(refused by name: not implemented). Older configs spell some fields ``mamba_*``; both
spellings are read, as transformers reads them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
_BLOCK_TYPES = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION,
                "attention": ATTENTION, "mlp": MLP, "moe": MOE}
# transformers' legacy names of NemotronHConfig fields (its __post_init__ reads them too).
_ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv",
            "use_conv_bias": "mamba_conv_bias", "chunk_size": "mamba_chunk_size",
            "time_step_limit": "mamba_dt_limit", "head_dim": "attention_head_dim"}


@dataclass(frozen=True)
class HybridSpec:
    """The layer pattern and Mamba-2 sizes of a hybrid model."""

    layer_types: str  # one character per layer: M, * or -
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool  # in_proj / out_proj bias (config use_bias)
    chunk_size: int
    time_step_limit: tuple[float, float]

    @property
    def d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def num_mamba_layers(self) -> int:
        return self.layer_types.count(MAMBA)

    @property
    def num_attention_layers(self) -> int:
        return self.layer_types.count(ATTENTION)

    def state_bytes_per_sequence(self, dtype_bytes: int) -> int:
        """One sequence's state over all Mamba layers: the conv state (K - 1 inputs), the
        fp32 SSM state and the open chunk's rows ([xBC | dt], model dtype)."""
        conv = (self.conv_kernel - 1) * self.conv_dim * dtype_bytes
        ssm = self.mamba_num_heads * self.mamba_head_dim * self.ssm_state_size * 4
        rows = self.chunk_size * (self.conv_dim + self.mamba_num_heads) * dtype_bytes
        return self.num_mamba_layers * (conv + ssm + rows)

    def canonical(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        lo, hi = self.time_step_limit
        d["time_step_limit"] = [lo, "inf" if math.isinf(hi) else hi]
        return d


def nemotron_h_fields(
    cfg: Mapping[str, Any], source: str, reader_cls: Callable[[Mapping[str, Any], str], Any],
    token_ids: Callable[[Mapping[str, Any], str, str], tuple[int, ...]], max_tokens: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ModelSpec fields but the dtype, the config as transformers reads it) of a
    NemotronHForCausalLM config.json; ValueError naming the problem. ``reader_cls`` is
    models/spec.py's checked field reader, ``token_ids`` its id-list reader."""
    cfg = dict(cfg)
    for name, legacy in _ALIASES.items():
        if cfg.get(name) is None and cfg.get(legacy) is not None:
            cfg[name] = cfg[legacy]
    limit = _time_step_limit(cfg.get("time_step_limit"), source)
    if cfg.get("time_step_limit") is not None:
        cfg["time_step_limit"] = list(limit)  # as transformers decodes it
    r = reader_cls(cfg, source)
    pattern = _pattern(cfg, source)
    layers = cfg.get("num_hidden_layers")
    if layers is not None and layers != len(pattern):
        raise ValueError(f"{source}: num_hidden_layers={layers!r} but the layer pattern has "
                         f"{len(pattern)} layers ({pattern})")
    for key, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        got = cfg.get(key, want)
        if got != want:
            raise ValueError(f"{source}: {key} {got!r} is not supported (only {want!r})")
    if cfg.get("sliding_window") is not None:
        raise ValueError(f"{source}: sliding_window is not supported for NemotronH")
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    kv_heads = r.int("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    if cfg.get("head_dim") is None and hidden % heads:
        raise ValueError(f"{source}: hidden_size ({hidden}) must be a multiple of "
                         f"num_attention_heads ({heads}) when head_dim is not given")
    m_heads = r.int("mamba_num_heads")
    groups = r.int("n_groups", default=8)
    if m_heads % groups:
        raise ValueError(f"{source}: mamba_num_heads ({m_heads}) must be a multiple of "
                         f"n_groups ({groups})")
    conv_kernel = r.int("conv_kernel", default=4, high=64)
    if conv_kernel < 2:
        raise ValueError(f"{source}: conv_kernel must be at least 2, got {conv_kernel}")
    hybrid = HybridSpec(
        layer_types=pattern,
        mamba_num_heads=m_heads,
        mamba_head_dim=r.int("mamba_head_dim"),
        n_groups=groups,
        ssm_state_size=r.int("ssm_state_size", default=128),
        conv_kernel=conv_kernel,
        conv_bias=r.bool("use_conv_bias", default=True),
        proj_bias=r.bool("use_bias", default=False),
        chunk_size=r.int("chunk_size", default=128, high=4096),
        time_step_limit=limit,
    )
    fields = dict(
        architecture="NemotronHForCausalLM",
        vocab_size=r.int("vocab_size", high=max_tokens),
        hidden_size=hidden,
        intermediate_size=r.int("intermediate_size"),
        num_layers=len(pattern),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=r.int("head_dim", default=hidden // heads),
        rms_norm_eps=r.float("layer_norm_epsilon", default=1e-5, below=1.0),
        rope_theta=0.0,  # no position embedding
        rope_scaling=None,
        max_position_embeddings=r.int("max_position_embeddings", default=4096,
                                      high=max_tokens),
        tie_word_embeddings=r.bool("tie_word_embeddings", default=False),
        attention_bias=r.bool("attention_bias", default=False),
        mlp_bias=r.bool("mlp_bias", default=False),
        qk_norm=False,
        bos_token_id=next(iter(token_ids(cfg, "bos_token_id", source)), None),
        eos_token_id=token_ids(cfg, "eos_token_id", source),
        hybrid=hybrid,
    )
    return fields, cfg


def _pattern(cfg: Mapping[str, Any], source: str) -> str:
    text = cfg.get("hybrid_override_pattern")
    listed = cfg.get("layers_block_type") or cfg.get("layer_types")
    if isinstance(text, str) and text:
        pattern = text
    elif isinstance(listed, list) and listed:
        unknown = sorted({str(t) for t in listed if t not in _BLOCK_TYPES})
        if unknown:
            raise ValueError(f"{source}: layers_block_type holds unknown layer types {unknown}")
        pattern = "".join(_BLOCK_TYPES[t] for t in listed)
    else:
        raise ValueError(f"{source}: NemotronH needs hybrid_override_pattern or "
                         "layers_block_type (the layer pattern)")
    bad = sorted(set(pattern) - {MAMBA, ATTENTION, MLP, MOE})
    if bad:
        raise ValueError(f"{source}: hybrid_override_pattern {pattern!r} holds unknown layer "
                         f"characters {bad} (M, *, - and E are defined)")
    if MOE in pattern:
        raise ValueError(f"{source}: mixture-of-experts layers (E in the layer pattern, "
                         f"{pattern.count(MOE)} of them) are not supported yet: detlora runs "
                         "NemotronH models of Mamba-2 (M), attention (*) and MLP (-) layers")
    return pattern


def _time_step_limit(value: object, source: str) -> tuple[float, float]:
    if value is None:
        return (0.0, math.inf)
    if isinstance(value, (list, tuple)):  # transformers 5.x writes inf as {"__float__": ...}
        value = [_special_float(v) for v in value]
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value)):
        raise ValueError(f"{source}: time_step_limit must be [low, high], got {value!r}")
    lo, hi = float(value[0]), float(value[1])
    if math.isnan(lo) or math.isnan(hi) or lo < 0 or hi <= lo:
        raise ValueError(f"{source}: time_step_limit must have 0 <= low < high, got {value!r}")
    return lo, hi


def _special_float(v: object) -> object:
    """``{"__float__": "Infinity"}`` (how transformers 5.x saves non-finite floats) as a
    float; anything else as it is."""
    if isinstance(v, dict) and set(v) == {"__float__"} and v["__float__"] in (
            "Infinity", "-Infinity", "NaN"):
        return float(v["__float__"].lower().replace("infinity", "inf"))
    return v
