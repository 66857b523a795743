"""Gemma 3 and Gemma 4 ``config.json`` -> ``ModelSpec``: the text models (``...ForCausalLM``)
and the text tower of the multimodal checkpoints (``...ForConditionalGeneration``, its
fields under ``text_config``, its weights under ``model.language_model.``).

What config.json asks for that the engine does not implement is refused by name (Gemma 4's
mixture of experts, keys that are values, bidirectional attention, attention soft-capping,
other activations or rotary types). Then transformers' config class reads the JSON, as
``from_pretrained`` would, so that the defaults, the layer types (Gemma 3's
``sliding_window_pattern``, Gemma 4's forced full last layer), the rotary parameters of each
layer type, Gemma 4's per-layer head sizes and its KV-sharing map are exactly HF's; every
number taken from it is checked.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from detlora.models.config_fields import _DTYPES, _positive, _Reader, _token_ids
from detlora.models.layer_spec import (
    LayerAttention,
    RopeSpec,
    check_layer_attention,
    frozen_mapping,
)

logger = logging.getLogger("detlora")

_ACTIVATIONS = ("gelu_pytorch_tanh",)  # HF's ACT2FN name of gelu(x, approximate="tanh")
_ROPE_TYPES = {3: ("default", "linear"), 4: ("default", "proportional", "linear")}
# Multimodal placeholder ids HF embeds as the pad token in a text-only forward: Gemma 4
# always, Gemma 3 where the id lies outside the text vocabulary.
_PLACEHOLDERS = {3: ("image_token_id",), 4: ("image_token_id", "video_token_id",
                                              "audio_token_id")}


@dataclass(frozen=True)
class GemmaSpec:
    """What Gemma 3 and 4 add to a decoder (models/gemma3.py, models/gemma4.py read it)."""

    version: int  # 3 or 4
    weight_prefix: str  # "model." (...ForCausalLM) or "model.language_model." (multimodal)
    norm_unit_offset: bool  # RMSNorm scales by 1 + w (Gemma 3) rather than by w (Gemma 4)
    v_norm: bool  # V goes through a weightless RMSNorm (Gemma 4)
    layer_scalars: bool  # each layer ends scaling the residual stream by its layer_scalar
    final_logit_softcapping: float | None  # logits = cap * tanh(logits / cap)
    per_layer_input_size: int  # per-layer embeddings (PLE) per layer; 0: none
    per_layer_vocab_size: int
    intermediate_sizes: tuple[int, ...]  # MLP width per layer (double-wide on shared layers)
    pad_token_id: int
    placeholder_token_ids: tuple[int, ...]  # embedded as pad_token_id, as HF does

    def canonical(self) -> dict[str, Any]:
        d = asdict(self)
        d["intermediate_sizes"] = list(self.intermediate_sizes)
        d["placeholder_token_ids"] = list(self.placeholder_token_ids)
        return d


def gemma_spec_fields(cfg: Mapping[str, Any], arch: str, model_type: str,
                      source: str) -> dict[str, Any]:
    """The ModelSpec fields of a Gemma 3 / Gemma 4 config.json (``arch`` already checked;
    ``model_type``: its HF model type)."""
    version = 4 if arch.startswith("Gemma4") else 3
    multimodal = arch.endswith("ForConditionalGeneration")
    raw = cfg.get("text_config") if multimodal else cfg
    where = f"{source} (text_config)" if multimodal else source
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: {arch} needs a text_config object, got {raw!r}")
    for c, w in ((cfg, source), (raw, where)):
        _refuse_quantized(c, w)
    _refuse_unsupported(raw, where, version)
    hf = _hf_config(cfg, model_type, source)
    text = hf.get_text_config() if multimodal else hf
    values = text.to_dict()
    r = _Reader(values, where)
    layers = r.int("num_hidden_layers")
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    kv_heads = r.int("num_key_value_heads")
    head_dim = r.int("head_dim")
    layer_types = list(text.layer_types)
    if len(layer_types) != layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{where}: layer_types must name sliding_attention or full_attention "
                         f"for each of the {layers} layers, got {layer_types!r}")
    window = r.int("sliding_window")
    attention = _layer_attention(text, version, layer_types, window, heads, where)
    intermediate = r.int("intermediate_size")
    sizes = [intermediate] * layers
    if version == 4 and values.get("use_double_wide_mlp"):
        sizes = [2 * intermediate if a.kv_source is not None else intermediate
                 for a in attention]
    ple = int(values.get("hidden_size_per_layer_input") or 0) if version == 4 else 0
    ple_vocab = r.int("vocab_size_per_layer_input") if ple else 0
    if ple and not 1 <= ple <= 1 << 16:
        raise ValueError(f"{where}: hidden_size_per_layer_input must be in [0, 65536], "
                         f"got {ple}")
    cap = values.get("final_logit_softcapping")
    if cap is not None and not _positive(cap):
        raise ValueError(f"{where}: final_logit_softcapping must be a finite positive number "
                         f"or null, got {cap!r}")
    vocab = r.int("vocab_size", high=(1 << 31) - 1)
    pad = values.get("pad_token_id")
    pad = 0 if pad is None else pad
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < vocab:
        raise ValueError(f"{where}: pad_token_id must be a token id below vocab_size, "
                         f"got {pad!r}")
    placeholders = _placeholders(hf, version, vocab, multimodal)
    gemma = GemmaSpec(
        version=version,
        weight_prefix="model.language_model." if multimodal else "model.",
        norm_unit_offset=version == 3, v_norm=version == 4, layer_scalars=version == 4,
        final_logit_softcapping=None if cap is None else float(cap),
        per_layer_input_size=ple, per_layer_vocab_size=ple_vocab,
        intermediate_sizes=tuple(sizes), pad_token_id=pad,
        placeholder_token_ids=placeholders)
    ids = cfg if cfg.get("eos_token_id") is not None else values
    full = next((a for a in attention if a.window is None), attention[0])
    return dict(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=r.float("rms_norm_eps", below=1.0),
        rope_theta=full.rope.theta,
        rope_scaling=full.rope.scaling,
        max_position_embeddings=r.int("max_position_embeddings", high=(1 << 31) - 1),
        tie_word_embeddings=_tied(cfg, values, where),
        attention_bias=r.bool("attention_bias", default=False),
        mlp_bias=False,
        qk_norm=True,
        bos_token_id=next(iter(_token_ids(ids, "bos_token_id", source)), None),
        eos_token_id=_token_ids(ids, "eos_token_id", source),
        dtype=_dtype(hf, cfg, raw, source),
        layer_attention=tuple(attention),
        gemma=gemma,
    )


def _refuse_quantized(cfg: Mapping[str, Any], source: str) -> None:
    for key in ("quantization_config", "compression_config"):
        if cfg.get(key):
            raise ValueError(f"{source}: {key}: quantized checkpoints are not supported; "
                             "detlora loads unquantized float32, bfloat16 or float16 weights")


def _refuse_unsupported(raw: Mapping[str, Any], source: str, version: int) -> None:
    """Refuse, by name, what the raw text config asks for that the engine does not do."""
    if version == 4 and raw.get("enable_moe_block"):
        raise ValueError(f"{source}: Gemma 4's mixture-of-experts variant (enable_moe_block="
                         "true) is not supported; detlora runs the dense Gemma 4 models")
    if version == 4 and raw.get("attention_k_eq_v"):
        raise ValueError(f"{source}: attention_k_eq_v=true (values read from the key "
                         "projection) is not supported")
    bidirectional = raw.get("use_bidirectional_attention")
    if bidirectional not in (None, False, "vision"):
        raise ValueError(f"{source}: use_bidirectional_attention={bidirectional!r} is not "
                         "supported (text attends causally)")
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{source}: attn_logit_softcapping is not supported")
    act = raw.get("hidden_activation", raw.get("hidden_act", _ACTIVATIONS[0]))
    if act not in _ACTIVATIONS:
        raise ValueError(f"{source}: hidden_activation {act!r} is not supported (supported: "
                         f"{', '.join(_ACTIVATIONS)})")
    for key in ("sliding_window", "final_logit_softcapping", "query_pre_attn_scalar"):
        v = raw.get(key)
        if v is not None and not _positive(v):
            raise ValueError(f"{source}: {key} must be a finite positive number, got {v!r}")


def _hf_config(cfg: Mapping[str, Any], model_type: str, source: str) -> Any:
    """``cfg`` as transformers' config class of ``model_type`` reads it (nothing fetched)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # its own validation, of what the checks here let through
        raise ValueError(f"{source}: transformers cannot read it ({type(e).__name__}: "
                         f"{e})") from e


def _layer_attention(text: Any, version: int, layer_types: list[str], window: int,
                     heads: int, source: str) -> list[LayerAttention]:
    """Each layer's attention as HF builds it: window, head size, KV heads, softmax scale,
    rotary table of its layer type, and (Gemma 4) the layer whose K/V it reads."""
    ropes = {t: _rope(text.rope_parameters, t, version, source) for t in set(layer_types)}
    if version == 3:
        scalar = text.query_pre_attn_scalar
        if not _positive(scalar):
            raise ValueError(f"{source}: query_pre_attn_scalar must be a finite positive "
                             f"number, got {scalar!r}")
        scale = float(scalar) ** -0.5
        hd, kv = int(text.head_dim), int(text.num_key_value_heads)
        shapes = [(hd, kv)] * len(layer_types)
        sources: list[int | None] = [None] * len(layer_types)
    else:
        scale = 1.0  # Gemma 4: q and k are RMS-normed, the softmax is not scaled
        try:
            modes = list(text.kv_sharing_modes)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        if all(m == "reuse" for m in modes):
            raise ValueError(f"{source}: num_kv_shared_layers leaves no layer that computes "
                             "its own keys and values")
        store = {layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
        sources = [store[layer_types[i]] if m == "reuse" else None
                   for i, m in enumerate(modes)]
        shapes = [(int(text.per_layer_config[i].head_dim),
                   int(text.per_layer_config[i].num_key_value_heads))
                  for i in range(len(layer_types))]
    out: list[LayerAttention] = []
    for i, t in enumerate(layer_types):
        hd, kv = shapes[i]
        if hd < 2 or hd % 2 or kv < 1 or heads % kv:
            raise ValueError(f"{source}: layer {i} has head_dim {hd} and {kv} KV heads; "
                             f"head_dim must be even and {heads} heads a multiple of the KV "
                             "heads")
        out.append(LayerAttention(
            head_dim=hd, num_kv_heads=kv, rope=ropes[t], scale=scale, kv_source=sources[i],
            window=window if t == "sliding_attention" else None))
    check_layer_attention(out, source)
    return out


def _rope(params: Mapping[str, Any], layer_type: str, version: int, source: str) -> RopeSpec:
    p = params.get(layer_type) if isinstance(params, Mapping) else None
    if not isinstance(p, Mapping):
        raise ValueError(f"{source}: rope_parameters has no entry for {layer_type}")
    kind = p.get("rope_type", "default")
    if kind not in _ROPE_TYPES[version]:
        raise ValueError(f"{source}: rope type {kind!r} of {layer_type} is not supported "
                         f"(supported: {', '.join(_ROPE_TYPES[version])})")
    theta = p.get("rope_theta")
    if not _positive(theta):
        raise ValueError(f"{source}: rope_theta of {layer_type} must be a finite positive "
                         f"number, got {theta!r}")
    if kind == "default":
        return RopeSpec(float(theta))
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = p.get("factor", 1.0 if kind == "proportional" else None)
    if not _positive(factor):
        raise ValueError(f"{source}: rope factor of {layer_type} must be a finite positive "
                         f"number, got {factor!r}")
    scaling["factor"] = float(factor)
    if kind == "proportional":
        partial = p.get("partial_rotary_factor", 1.0)
        if not _positive(partial) or partial > 1:
            raise ValueError(f"{source}: partial_rotary_factor of {layer_type} must be in "
                             f"(0, 1], got {partial!r}")
        scaling["partial_rotary_factor"] = float(partial)
    return RopeSpec(float(theta), frozen_mapping(scaling))


def _placeholders(hf: Any, version: int, vocab: int, multimodal: bool) -> tuple[int, ...]:
    """The multimodal placeholder ids HF embeds as the pad token in a text-only forward."""
    if not multimodal:
        return ()
    ids = {getattr(hf, key, None) for key in _PLACEHOLDERS[version]}
    return tuple(sorted(v for v in ids if isinstance(v, int) and not isinstance(v, bool)
                        and v >= 0 and (version == 4 or v >= vocab)))


def _tied(cfg: Mapping[str, Any], values: Mapping[str, Any], source: str) -> bool:
    tie = cfg.get("tie_word_embeddings", values.get("tie_word_embeddings", True))
    if tie is None:
        return True
    if not isinstance(tie, bool):
        raise ValueError(f"{source}: tie_word_embeddings must be true or false, got {tie!r}")
    return tie


def _dtype(hf: Any, cfg: Mapping[str, Any], raw: Mapping[str, Any], source: str) -> Any:
    import torch

    for c in (cfg, raw):
        for key in ("dtype", "torch_dtype"):
            name = c.get(key)
            if name is not None and (not isinstance(name, str) or name not in _DTYPES):
                raise ValueError(f"{source}: dtype {name!r} is not supported "
                                 f"(supported: {', '.join(_DTYPES)})")
    for c in (cfg, raw):
        for key in ("dtype", "torch_dtype"):
            if c.get(key) is not None:
                return _DTYPES[c[key]]
    dtype = getattr(hf, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
