"""Gemma 3 and Gemma 4 ``config.json`` -> ``ModelSpec``: the text models (``...ForCausalLM``)
and the text tower of the multimodal checkpoints (``...ForConditionalGeneration``, its
fields under ``text_config``, its weights under ``model.language_model.``).

What config.json asks for that the engine does not implement is refused by name (Gemma 4's
mixture of experts, keys that are values, bidirectional attention, attention soft-capping,
other activations or rotary types). Then transformers' config class reads the JSON, as
``from_pretrained`` would, so that the defaults and the layer types (Gemma 3's
``sliding_window_pattern``, Gemma 4's forced full last layer) are exactly HF's; every number
taken from it is checked.

What transformers releases spell differently is read here, the same for every release the
package allows (``transformers>=4.56``): the rotary parameters of each layer type (4.x has
``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` attributes, 5.x
``rope_parameters``), Gemma 4's per-layer head sizes (``global_head_dim`` in config.json
before the heterogeneous configs of 5.1x, ``per_layer_config`` as those save it) and its
KV-sharing map (HF's rule; the config property ``kv_sharing_modes`` exists only in recent
releases). A release without the model type's config class (Gemma 4 before 5.5.0) gets an
error naming the release needed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
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
# The first transformers release with the config class of a model type (Gemma 3's, 4.50, is
# older than the oldest release the package allows).
_FIRST_RELEASE: Mapping[str, str] = MappingProxyType({"gemma4_text": "5.5.0",
                                                      "gemma4": "5.5.0"})
# What a Gemma 4 per_layer_config entry may override (what HF's own config writes there).
_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")


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
    hf = _hf_config(cfg, model_type, arch, source)
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
    attention = _layer_attention(text, raw, version, layer_types, window,
                                 (heads, head_dim, kv_heads), where)
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
    for params in _raw_rope_entries(raw):  # before transformers reads them (some raise)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in _ROPE_TYPES[version]:
            raise ValueError(f"{source}: rope type {kind!r} is not supported (supported: "
                             f"{', '.join(_ROPE_TYPES[version])})")


def _raw_rope_entries(raw: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The rotary parameter objects of a raw text config: ``rope_scaling`` (4.x spelling),
    ``rope_parameters`` (5.x: one per layer type, or one for all)."""
    out = [raw["rope_scaling"]] if isinstance(raw.get("rope_scaling"), Mapping) else []
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping):
        nested = [v for v in params.values() if isinstance(v, Mapping)]
        out += nested if nested else [params]
    return out


def _hf_config(cfg: Mapping[str, Any], model_type: str, arch: str, source: str) -> Any:
    """``cfg`` as transformers' config class of ``model_type`` reads it (nothing fetched);
    ValueError naming the release needed where the installed one has no such class."""
    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig

    if model_type not in CONFIG_MAPPING:
        need = _FIRST_RELEASE.get(model_type, "a release that has it")
        raise ValueError(f"{source}: {arch} needs transformers >= {need} to read its config "
                         f"(installed: {transformers.__version__}); upgrade it with "
                         f"pip install -U 'transformers>={need}'")
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # its own validation, of what the checks here let through
        raise ValueError(f"{source}: transformers cannot read it ({type(e).__name__}: "
                         f"{e})") from e


def _layer_attention(text: Any, raw: Mapping[str, Any], version: int, layer_types: list[str],
                     window: int, sizes: tuple[int, int, int],
                     source: str) -> list[LayerAttention]:
    """Each layer's attention as HF builds it: window, head size, KV heads, softmax scale,
    rotary table of its layer type, and (Gemma 4) the layer whose K/V it reads. ``sizes``:
    the query heads and the config-wide head_dim and KV heads, read from ``to_dict()``
    (the heterogeneous configs of transformers 5.1x refuse ``text.head_dim``)."""
    heads, head_dim, kv_heads = sizes
    params = _rope_parameters(text)
    ropes = {t: _rope(params, t, version, source) for t in set(layer_types)}
    if version == 3:
        scalar = text.query_pre_attn_scalar
        if not _positive(scalar):
            raise ValueError(f"{source}: query_pre_attn_scalar must be a finite positive "
                             f"number, got {scalar!r}")
        scale = float(scalar) ** -0.5
        shapes = [(head_dim, kv_heads)] * len(layer_types)
        sources: list[int | None] = [None] * len(layer_types)
    else:
        scale = 1.0  # Gemma 4: q and k are RMS-normed, the softmax is not scaled
        sources = _kv_sources(raw, layer_types, source)
        shapes = _gemma4_shapes(raw, head_dim, kv_heads, layer_types, source)
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


def _kv_sources(raw: Mapping[str, Any], layer_types: list[str],
                source: str) -> list[int | None]:
    """Gemma 4's KV sharing, by the rule every transformers release with Gemma 4 applies (the
    config property ``kv_sharing_modes`` is recent: 5.24 has it, 5.17 not): the last
    ``num_kv_shared_layers`` layers compute no K/V and read those of the last earlier layer
    of their own type. None: the layer computes its own."""
    shared = raw.get("num_kv_shared_layers", 0)
    if isinstance(shared, bool) or not isinstance(shared, int) or not (
            0 <= shared <= len(layer_types)):
        raise ValueError(f"{source}: num_kv_shared_layers must be an integer in "
                         f"[0, {len(layer_types)}], got {shared!r}")
    first = len(layer_types) - shared
    if shared and first == 0:
        raise ValueError(f"{source}: num_kv_shared_layers leaves no layer that computes its "
                         "own keys and values")
    producer = {t: i for i, t in enumerate(layer_types[:first])}  # the last of each type
    out: list[int | None] = [None] * first
    for i in range(first, len(layer_types)):
        if layer_types[i] not in producer:
            raise ValueError(f"{source}: layer {i} ({layer_types[i]}) shares keys and values "
                             f"but none of layers 0-{first - 1} computes them for its type")
        out.append(producer[layer_types[i]])
    return out


def _gemma4_shapes(raw: Mapping[str, Any], head_dim: int, kv_heads: int,
                   layer_types: list[str], source: str) -> list[tuple[int, int]]:
    """(head_dim, KV heads) of each Gemma 4 layer, from config.json in either spelling:
    ``per_layer_config`` where it has one (what the heterogeneous configs of transformers
    5.1x and later save; they fold ``global_head_dim`` into it), else ``global_head_dim``
    on the full-attention layers (default 512, as every release reads it)."""
    shapes = [(head_dim, kv_heads)] * len(layer_types)
    if raw.get("per_layer_config") is not None:
        for i, layer in _per_layer_overrides(raw["per_layer_config"], len(layer_types),
                                             source).items():
            shapes[i] = (layer.get("head_dim", head_dim),
                         layer.get("num_key_value_heads", kv_heads))
        return shapes
    full = raw.get("global_head_dim", 512)
    if isinstance(full, bool) or not isinstance(full, int) or full < 1:
        raise ValueError(f"{source}: global_head_dim must be a positive integer, got {full!r}")
    return [(full, kv_heads) if t == "full_attention" else s
            for t, s in zip(layer_types, shapes, strict=True)]


def _per_layer_overrides(overrides: Any, layers: int,
                         source: str) -> dict[int, Mapping[str, int]]:
    """config.json's ``per_layer_config`` by layer index, checked: keys are layer indices
    (transformers writes them as zero-padded strings, "07"), values override only what
    Gemma 4's own config writes there (``_LAYER_OVERRIDES``), as integers."""
    if not isinstance(overrides, Mapping):
        raise ValueError(f"{source}: per_layer_config must be an object, got {overrides!r}")
    out: dict[int, Mapping[str, int]] = {}
    for key, layer in overrides.items():
        index = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < layers:
            raise ValueError(f"{source}: per_layer_config key {key!r} is not a layer index "
                             f"in [0, {layers})")
        if not isinstance(layer, Mapping) or set(layer) - set(_LAYER_OVERRIDES):
            raise ValueError(f"{source}: per_layer_config[{key!r}] may override only "
                             f"{', '.join(_LAYER_OVERRIDES)}, got {layer!r}")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in layer.values()):
            raise ValueError(f"{source}: per_layer_config[{key!r}] must give integers, got "
                             f"{layer!r}")
        out[index] = layer
    return out


def _rope_parameters(text: Any) -> Mapping[str, Any]:
    """The rotary parameters of each layer type: 5.x's ``rope_parameters``; in 4.x, built from
    the attributes its Gemma 3 reads (the full layers' ``rope_theta`` and ``rope_scaling``,
    the sliding layers' ``rope_local_base_freq``, unscaled)."""
    params = getattr(text, "rope_parameters", None)
    if isinstance(params, Mapping):
        return params
    scaling = getattr(text, "rope_scaling", None)
    scaling = dict(scaling) if isinstance(scaling, Mapping) else {}
    kind, legacy = scaling.pop("rope_type", None), scaling.pop("type", None)
    full = {**scaling, "rope_type": kind or legacy or "default",
            "rope_theta": getattr(text, "rope_theta", None)}
    return {"full_attention": full,
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": getattr(text, "rope_local_base_freq", None)}}


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
