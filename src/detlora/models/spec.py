"""What a model is, read from a Hugging Face ``config.json`` and checked field by field.

Every field is checked on the raw JSON: numbers finite and in range, and checkpoint features
the engine does not implement (quantized weights, soft-capping, partial rotary) refused by
name: loading them as if they were plain weights would run garbage. Sliding windows are read
per layer as each family's transformers code reads them (``_WINDOWS``); the model applies
them (``models/windows.py``).
Then transformers' config class for the architecture reads the same JSON, and the dtype is
taken as it normalises it (``torch_dtype`` in 4.x, ``dtype`` in 5.x). The rotary fields, in
either spelling (``rope_theta`` + ``rope_scaling`` in 4.x, ``rope_parameters`` in 5.x), are
read by hand: see ``_ROPE_KEYS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from detlora.json_files import read_json_object
from detlora.models.config_fields import (  # noqa: F401 (_MAX_SIZE: a name others use)
    _DTYPES,
    _MAX_SIZE,
    _MAX_TOKENS,
    _positive,
    _Reader,
    _token_ids,
)
from detlora.models.gemma_config import GemmaSpec, gemma_spec_fields
from detlora.models.hybrid_spec import HybridSpec, nemotron_h_fields
from detlora.models.layer_spec import KVGroup, LayerAttention, RopeSpec, kv_groups

# architecture -> HF model_type. Llama, Qwen2/3, Mistral and Phi-3: decoder-only, pre-norm,
# SwiGLU, neox rotary, GQA; Gemma 3 and 4 (models/gemma_config.py reads them) differ per layer;
# NemotronH is a hybrid of Mamba-2, attention and MLP layers (models/hybrid_spec.py).
SUPPORTED_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2",
     "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3",
     "Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3",
     "Gemma4ForCausalLM": "gemma4_text", "Gemma4ForConditionalGeneration": "gemma4",
     "NemotronHForCausalLM": "nemotron_h"}
)
# Architectures whose config.json models/gemma_config.py reads.
GEMMA_ARCHITECTURES = frozenset(a for a in SUPPORTED_ARCHITECTURES if a.startswith("Gemma"))
_QK_NORM = frozenset({"Qwen3ForCausalLM"})  # per-head RMSNorm of q and k before rotary
_ROPE_TYPES = ("default", "llama3")
# Features fixed by an architecture's transformers code rather than read from config.json.
_QKV_BIAS = frozenset({"Qwen2ForCausalLM"})  # q/k/v biases always, no o_proj bias
# transformers builds these without biases whatever attention_bias / mlp_bias say.
_NO_CONFIG_BIAS = frozenset({"Qwen2ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM"})
# Rotary types per architecture (others: _ROPE_TYPES), and the names transformers maps.
_ARCH_ROPE_TYPES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"Phi3ForCausalLM": ("default", "longrope")})
_ARCH_ROPE_ALIASES: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {"Phi3ForCausalLM": {"su": "longrope", "yarn": "longrope"}})  # as Phi3Config reads them


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None  # llama3 scaling parameters, or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before rotary (Qwen3)
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]  # config.json's int or list (generation_config may add more)
    dtype: torch.dtype  # the checkpoint's dtype (float32 when config.json names none)
    qkv_bias: bool = False  # biases on q, k and v only, none on o_proj (Qwen2)
    # Per layer: its sliding window (a query at p sees keys p - w < j <= p) or None for full
    # attention; empty when every layer is full. See models/windows.py.
    layer_windows: tuple[int | None, ...] = ()
    # Per layer, where layers differ in more than a window (head sizes, shared K/V, scales:
    # Gemma); None: every layer is ``LayerAttention`` of the fields above (``attention``).
    layer_attention: tuple[LayerAttention, ...] | None = None
    gemma: GemmaSpec | None = None  # Gemma 3 / 4 only (models/gemma_config.py)
    hybrid: HybridSpec | None = None  # layer pattern and Mamba-2 sizes (NemotronH)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The checkpoint's dtype under its transformers 4.x name."""
        return self.dtype

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attention(self, layer: int) -> LayerAttention:
        """Layer ``layer``'s attention: its own entry, or the uniform one of every layer."""
        if self.layer_attention is not None:
            return self.layer_attention[layer]
        return LayerAttention(self.head_dim, self.num_kv_heads,
                              RopeSpec(self.rope_theta, self.rope_scaling))

    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The groups of KV pages (models/layer_spec.py): one full-attention group of every
        layer unless layers have windows or share K/V."""
        return kv_groups([self.attention(i) for i in range(self.num_layers)])

    @property
    def num_attention_layers(self) -> int:
        """Layers with attention: all of them, but a hybrid's ``*`` layers."""
        return self.num_layers if self.hybrid is None else self.hybrid.num_attention_layers

    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over every layer with a cache of its own, in bytes (layers
        that read another's K/V add none; a windowed layer's pages are counted as if it kept
        them all: see ``kv_groups`` for what it keeps; a hybrid's attention layers only)."""
        elem = torch.empty(0, dtype=dtype).element_size()
        if self.hybrid is not None:
            return 2 * self.num_attention_layers * self.kv_size * elem
        return sum(2 * a.num_kv_heads * a.head_dim * elem
                   for a in map(self.attention, range(self.num_layers)) if a.is_producer)

    def canonical(self) -> dict[str, Any]:
        """Every field as plain JSON values, for hashing and reports."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        d["dtype"] = str(self.dtype).replace("torch.", "")
        d["eos_token_id"] = list(self.eos_token_id)
        d["layer_windows"] = list(self.layer_windows)
        for key in ("layer_attention", "gemma"):  # present only where set: older hashes hold
            if d[key] is None:
                del d[key]
        if self.layer_attention is not None:
            d["layer_attention"] = [a.canonical() for a in self.layer_attention]
        if self.gemma is not None:
            d["gemma"] = self.gemma.canonical()
        if self.hybrid is None:
            del d["hybrid"]  # the canonical form (and weights hashes) of other models as before
        else:
            d["hybrid"] = self.hybrid.canonical()
        return d

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        path = Path(path)
        cfg = read_json_object(path, "config.json", "model", "a model directory")
        return cls.from_config(cfg, source=str(path / "config.json"))

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, source: str = "config.json") -> ModelSpec:
        r = _Reader(cfg, source)
        arch = _architecture(cfg, source)
        if arch in GEMMA_ARCHITECTURES:
            return cls(**gemma_spec_fields(cfg, arch, SUPPORTED_ARCHITECTURES[arch], source))
        _refuse_unsupported(cfg, source)
        if arch == "NemotronHForCausalLM":
            # Read without transformers' NemotronHConfig, which 4.x lacks and 5.3-5.5 fail
            # on MLP layers ("-" in the pattern) with; only the dtype would come from it.
            fields, read = nemotron_h_fields(cfg, source, _Reader, _token_ids, _MAX_TOKENS)
            return cls(**fields, dtype=_named_dtype(read, source))
        hidden = r.int("hidden_size")
        heads = r.int("num_attention_heads")
        kv_heads = r.int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        if cfg.get("head_dim") is None and hidden % heads:
            raise ValueError(f"{source}: hidden_size ({hidden}) must be a multiple of "
                             f"num_attention_heads ({heads}) when head_dim is not given")
        head_dim = r.int("head_dim", default=hidden // heads)
        if head_dim % 2:
            raise ValueError(f"{source}: head_dim must be even for rotary, got {head_dim}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        layers = r.int("num_hidden_layers")
        windows = _WINDOWS.get(arch, _no_windows)(r, layers)
        theta, scaling = _rope(cfg, source, arch, head_dim)
        config_bias = arch not in _NO_CONFIG_BIAS
        return cls(
            architecture=arch,
            vocab_size=r.int("vocab_size", high=_MAX_TOKENS),
            hidden_size=hidden,
            intermediate_size=r.int("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=r.float("rms_norm_eps", default=1e-6, below=1.0),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=r.int("max_position_embeddings", high=_MAX_TOKENS),
            tie_word_embeddings=r.bool("tie_word_embeddings", default=False),
            attention_bias=config_bias and r.bool("attention_bias", default=False),
            mlp_bias=config_bias and r.bool("mlp_bias", default=False),
            qk_norm=arch in _QK_NORM,
            bos_token_id=next(iter(_token_ids(cfg, "bos_token_id", source)), None),
            eos_token_id=_token_ids(cfg, "eos_token_id", source),
            # Last: transformers reads the config once every check above has passed.
            dtype=_dtype(cfg, arch, source),
            qkv_bias=arch in _QKV_BIAS,
            layer_windows=windows,
        )


def _refuse_unsupported(cfg: Mapping[str, Any], source: str) -> None:
    """Refuse, by name, what config.json asks for that the engine does not implement."""
    for key in ("quantization_config", "compression_config"):
        q = cfg.get(key)
        if q:
            method = q.get("quant_method") or q.get("format") if isinstance(q, dict) else None
            what = f" ({method})" if method else ""
            raise ValueError(
                f"{source}: {key}{what}: quantized checkpoints are not supported; detlora "
                "loads unquantized float32, bfloat16 or float16 weights")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{source}: {key} is not supported")
    partial = cfg.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={partial!r} is not supported "
                         "(rotary over the whole head only)")


def _architecture(cfg: Mapping[str, Any], source: str) -> str:
    archs = cfg.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1:
            raise ValueError(f"{source}: architectures must name one architecture, got {archs!r}")
        arch = archs[0]
    else:  # configs written without a model class: fall back on model_type
        by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
        arch = by_type.get(cfg.get("model_type"), cfg.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def _rope(cfg: Mapping[str, Any], source: str, arch: str,
          head_dim: int) -> tuple[float, Mapping[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{source}: rope_parameters must be an object, got {params!r}")
    legacy = cfg.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, dict):
        raise ValueError(f"{source}: rope_scaling must be an object, got {legacy!r}")
    merged: dict[str, Any] = {**(legacy or {}), **(params or {})}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not _positive(theta):
        raise ValueError(f"{source}: rope_theta must be a finite positive number, "
                         f"got {theta!r}")
    kind = merged.get("rope_type", merged.get("type", "default"))
    kind = _ARCH_ROPE_ALIASES.get(arch, {}).get(kind, kind)
    supported = _ARCH_ROPE_TYPES.get(arch, _ROPE_TYPES)
    if kind not in supported:
        raise ValueError(f"{source}: rope type {kind!r} is not supported for {arch} "
                         f"(supported: {', '.join(supported)})")
    if kind == "default":
        return float(theta), None
    if kind == "longrope":
        return float(theta), _longrope(cfg, merged, source, head_dim)
    scaling: dict[str, Any] = {"rope_type": "llama3"}
    for key, default in (("factor", None), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                         ("original_max_position_embeddings", None)):
        v = merged.get(key, default)
        if v is None:
            raise ValueError(f"{source}: llama3 rope scaling needs {key!r}")
        if not _positive(v):
            raise ValueError(f"{source}: rope scaling {key} must be a finite positive number, "
                             f"got {v!r}")
        if key == "original_max_position_embeddings" and (
                not isinstance(v, int) or v > _MAX_TOKENS):
            raise ValueError(f"{source}: rope scaling {key} must be an integer in "
                             f"[1, {_MAX_TOKENS}], got {v!r}")
        scaling[key] = v
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"{source}: rope scaling high_freq_factor must exceed low_freq_factor")
    return float(theta), MappingProxyType(scaling)


def _longrope(cfg: Mapping[str, Any], merged: Mapping[str, Any], source: str,
              head_dim: int) -> Mapping[str, Any]:
    """Phi-3's LongRoPE ("su") as transformers 5.x reads it: ``original_max_position_embeddings``
    from the rotary fields, else config.json's top level (Phi3Config's default 4096);
    ``factor`` given or max_position_embeddings / original; ``attention_factor`` given or
    sqrt(1 + ln(factor) / ln(original)) (1 when factor <= 1). The factors have head_dim / 2
    entries each; which set a token uses: ``ops/longrope.py``."""
    original = merged.get("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings", 4096))
    if isinstance(original, bool) or not isinstance(original, int) or \
            not 1 <= original <= _MAX_TOKENS:
        raise ValueError(f"{source}: longrope original_max_position_embeddings must be an "
                         f"integer in [1, {_MAX_TOKENS}], got {original!r}")
    scaling: dict[str, Any] = {"rope_type": "longrope",
                               "original_max_position_embeddings": original}
    for key in ("short_factor", "long_factor"):
        v = merged.get(key)
        if not isinstance(v, list) or len(v) != head_dim // 2 or not all(
                _positive(x) for x in v):
            raise ValueError(f"{source}: longrope rope scaling needs {key!r}: a list of "
                             f"head_dim / 2 = {head_dim // 2} finite positive numbers, "
                             f"got {v!r:.80}")
        scaling[key] = tuple(float(x) for x in v)
    max_pos = cfg.get("max_position_embeddings")
    factor = merged.get("factor")
    if factor is None:
        if not _positive(max_pos):
            raise ValueError(f"{source}: max_position_embeddings must be a positive integer, "
                             f"got {max_pos!r}")
        factor = max_pos / original
    elif not _positive(factor):
        raise ValueError(f"{source}: rope scaling factor must be a finite positive number, "
                         f"got {factor!r}")
    attention = merged.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(original))
    elif not _positive(attention):
        raise ValueError(f"{source}: rope scaling attention_factor must be a finite positive "
                         f"number, got {attention!r}")
    scaling["attention_factor"] = float(attention)
    return MappingProxyType(scaling)


# ---- sliding windows, per architecture: (reader, num_layers) -> per-layer windows ----

_LAYER_TYPES = ("full_attention", "sliding_attention")


def _window_size(r: _Reader, default: int | None) -> int | None:
    """config.json's sliding_window: ``default`` when absent, None when null."""
    if "sliding_window" not in r.cfg:
        return default
    if r.cfg["sliding_window"] is None:
        return None
    return r.int("sliding_window", high=_MAX_TOKENS)


def _no_windows(r: _Reader, layers: int) -> tuple[int | None, ...]:
    """Families whose transformers code has no window: asking for one is refused."""
    if r.cfg.get("use_sliding_window"):
        raise ValueError(f"{r.source}: use_sliding_window=true is not supported")
    layer_types = r.cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{r.source}: layer_types {sorted(set(layer_types))} are not "
                         "supported (only full_attention)")
    return ()


def _qwen_windows(r: _Reader, layers: int) -> tuple[int | None, ...]:
    """Qwen2 / Qwen3 (Qwen2Config): sliding_window (default 4096) only with
    use_sliding_window, on the layers ``layer_types`` names sliding_attention; without
    layer_types, layers max_window_layers (default 28) and up."""
    use = r.bool("use_sliding_window", default=False)
    window = _window_size(r, 4096) if use else None
    types = r.cfg.get("layer_types")
    if types is None:
        first = r.int("max_window_layers", default=28, high=_MAX_TOKENS) if window else layers
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"{r.source}: layer_types must list {layers} entries among "
                         f"{list(_LAYER_TYPES)}, got {types!r:.120}")
    if window is None and "sliding_attention" in types:
        raise ValueError(f"{r.source}: layer_types names sliding_attention layers but no "
                         "window is set (use_sliding_window / sliding_window)")
    if window is None:
        return ()
    return tuple(window if t == "sliding_attention" else None for t in types)


def _every_layer_window(default: int | None) -> Callable[[_Reader, int],
                                                         tuple[int | None, ...]]:
    """Mistral (default 4096) and Phi-3 (default None): sliding_window on every layer, as
    their transformers code applies it (use_sliding_window and layer_types are not read)."""
    def windows(r: _Reader, layers: int) -> tuple[int | None, ...]:
        window = _window_size(r, default)
        return () if window is None else (window,) * layers
    return windows


_WINDOWS: Mapping[str, Callable[[_Reader, int], tuple[int | None, ...]]] = MappingProxyType({
    "Qwen2ForCausalLM": _qwen_windows, "Qwen3ForCausalLM": _qwen_windows,
    "MistralForCausalLM": _every_layer_window(4096), "Phi3ForCausalLM": _every_layer_window(None),
})


# Left out of what transformers reads, and read by _rope: transformers 5.x refuses llama3
# scaling without low/high_freq_factor (defaulted here) and fills in a missing
# original_max_position_embeddings (refused here).
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")


def _transformers_config(cfg: Mapping[str, Any], arch: str, source: str) -> Any:
    """``cfg`` read by transformers' config class for ``arch``, as
    ``AutoConfig.from_pretrained`` reads a config.json, less the rotary fields: the class
    is picked by the architecture (config.json may omit model_type), so nothing is fetched
    and no remote code runs."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k not in _ROPE_KEYS and k != "model_type"}
    try:
        return AutoConfig.for_model(SUPPORTED_ARCHITECTURES[arch], **fields)
    except Exception as e:  # its own validation, of what the checks here let through
        raise ValueError(f"{source}: transformers cannot read it ({type(e).__name__}: "
                         f"{e})") from e


def _named_dtype(cfg: Mapping[str, Any], source: str) -> torch.dtype:
    """The dtype config.json names, as transformers reads it (``dtype``, else
    ``torch_dtype``; float32 when it names none); refused by name outside ``_DTYPES``."""
    for key in ("dtype", "torch_dtype"):  # refused by name (transformers would raise on some)
        name = cfg.get(key)
        if name is not None and (not isinstance(name, str) or name not in _DTYPES):
            raise ValueError(f"{source}: dtype {name!r} is not supported "
                             f"(supported: {', '.join(_DTYPES)})")
    named = next((cfg[k] for k in ("dtype", "torch_dtype") if cfg.get(k) is not None), None)
    return torch.float32 if named is None else _DTYPES[named]


def _dtype(cfg: Mapping[str, Any], arch: str, source: str) -> torch.dtype:
    """The checkpoint's dtype as transformers reads it (``dtype``, else ``torch_dtype``;
    float32 when config.json names none), after transformers' config class has read the
    whole config.json."""
    _named_dtype(cfg, source)
    dtype = _transformers_config(cfg, arch, source).dtype
    return torch.float32 if dtype is None else dtype
