"""The decoder-only causal LM that Llama and Qwen3 share, and the model side of the
engine contract.

The engine (``engine/``) talks to a model through these methods only:

    model = load_model(path, dtype=..., device=..., backend=..., lora_config=LoRAConfig(...))
    model.spec                               # ModelSpec: layers, heads, head_dim, vocab, ...
    logits = model(batch, kv_caches)         # fp32 [len(batch.logits_indices), V]; kv_caches:
                                             # per layer (k_cache, v_cache), engine-allocated
    logits = model(batch, upcast=False)      # the same in the model dtype (the engine's
                                             # sampler): fp32 logits are exactly its .float()
    kv = model.allocate_kv_cache(n, size)    # or allocate and bind the pages once, then
    logits = model(batch)                    # run on the bound pages
    model.hidden_states(batch), model.compute_logits(h)   # the same in two steps
    model.weights_hash()                     # for fingerprints
    model.lora_linears(), model.lora_target_shapes()      # for the LoRA manager
    model.lora_fused_targets()               # HF modules spanning several slices (Phi-3)
    model.position_offset(len(seq))          # added to a sequence's positions (LongRoPE)

With a tensor-parallel group (``tp``) the model is this rank's shard: attention heads, MLP
columns and vocabulary rows split over the ranks (layers/parallel_linear.py,
layers/vocab_parallel.py), the KV cache holds this rank's KV heads, and ``forward`` returns
the full logits on every rank. Checkpoint and adapter tensors are handed over whole; each
layer keeps its part.

``forward`` does no host synchronisation of its own and keeps no per-step state, so it can be
captured in a CUDA graph around static ForwardBatch tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import ClassVar

import torch
from torch import nn

from detlora.distributed.group import TensorParallelGroup
from detlora.distributed.sharding import check_shardable
from detlora.layers.attention import Attention
from detlora.layers.backend import OpBackend
from detlora.layers.decoder_layer import DecoderLayer
from detlora.layers.forward_batch import ForwardBatch
from detlora.layers.linear import LinearBase
from detlora.layers.lora_slots import LoRAConfig
from detlora.layers.mlp import GatedMLP
from detlora.layers.norm import RMSNorm
from detlora.layers.rotary import RotaryEmbedding
from detlora.layers.vocab_parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from detlora.models.kv_cache import KVCache, LayerPages
from detlora.models.layer_spec import KVGroup, LayerAttention, kv_groups
from detlora.models.spec import ModelSpec
from detlora.models.windows import attention_windows
from detlora.ops.longrope import longrope_offsets_vary, longrope_position_offset

# PEFT names of the projections an adapter may target, per fused layer.
QKV_MODULES = ("q_proj", "k_proj", "v_proj")
GATE_UP_MODULES = ("gate_proj", "up_proj")

# A checkpoint weight: its expected shape and the function that copies it into place.
WeightSlot = tuple[tuple[int, ...], Callable[[torch.Tensor], None]]


class DecoderForCausalLM(nn.Module):
    """Embedding, N pre-norm decoder layers, final norm, LM head (tied or not).

    Subclasses name the HF architecture they load; the spec says the rest.
    """

    architecture: ClassVar[str]
    # HF module (under model.layers.N.) -> the slices of ours it holds, in row order: its
    # checkpoint weight is split at load, an adapter's B rows are split by slice (A shared).
    fused_modules: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})

    def __init__(
        self,
        spec: ModelSpec,
        *,
        backend: OpBackend,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        lora: LoRAConfig | None = None,
        max_positions: int | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        if spec.architecture != self.architecture:
            raise ValueError(f"{type(self).__name__} cannot be built from a "
                             f"{spec.architecture} config")
        self.spec = spec
        self.backend = backend
        self.dtype = dtype or spec.dtype
        self.lora_config = lora
        self.max_positions = max_positions or spec.max_position_embeddings
        self._weights_hash: str | None = None
        self.tp = tp or TensorParallelGroup.single(device or "cpu")
        if not self.tp.is_single:
            check_shardable(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                            intermediate_size=spec.intermediate_size, size=self.tp.size,
                            head_dim=spec.head_dim)
        kw = dict(backend=backend, dtype=self.dtype, device=device)
        par = dict(kw, tp=self.tp)
        self.device = device
        # Per layer: the sliding window config.json's window fields ask for (Mistral, Qwen2,
        # Qwen3, Phi-3), None where it cannot matter at max_positions (models/windows.py).
        self.windows = attention_windows(spec, self.max_positions)
        # Each layer's attention: the spec's where layers differ (Gemma), else the uniform
        # one with the window above.
        self.layer_attention: list[LayerAttention] = [
            spec.attention(i) if spec.layer_attention is not None
            else replace(spec.attention(i), window=self.windows[i])
            for i in range(spec.num_layers)]
        # KV page groups (one for a uniform model) and each layer's group: a layer that
        # reads another's K/V is in its producer's.
        self.kv_groups: tuple[KVGroup, ...] = kv_groups(self.layer_attention)
        self.layer_group = [0] * spec.num_layers
        for g, group in enumerate(self.kv_groups):
            for i in group.layers:
                self.layer_group[i] = g
        for i, a in enumerate(self.layer_attention):
            if a.kv_source is not None:
                self.layer_group[i] = self.layer_group[a.kv_source]
        self._rotaries: dict[tuple, RotaryEmbedding] = {}
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, **par)
        self.layers = nn.ModuleList(self.build_layers())
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.lm_head: ParallelLMHead | None = (
            None if spec.tie_word_embeddings
            else ParallelLMHead(spec.vocab_size, spec.hidden_size, **par)
        )

    # ---- construction (families override ``build_layers``) ----

    def build_layers(self) -> list[nn.Module]:
        """The decoder layers: pre-norm blocks (Llama, Qwen3; a window where the spec sets
        one)."""
        spec, kw = self.spec, self._kw()
        return [
            DecoderLayer(
                self.build_attention(i, qk_norm_eps=spec.rms_norm_eps if spec.qk_norm
                                     else None),
                GatedMLP(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias,
                         lora=self.lora_config, **kw, tp=self.tp),
                RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw),
                RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw),
            )
            for i in range(spec.num_layers)
        ]

    def _kw(self) -> dict:
        return dict(backend=self.backend, dtype=self.dtype, device=self.device)

    def rotary_for(self, a: LayerAttention) -> RotaryEmbedding:
        """The cos/sin table of a layer's head size and rotary parameters, one per distinct
        pair (every layer of a uniform model shares one)."""
        scaling = tuple(sorted(a.rope.scaling.items())) if a.rope.scaling else None
        key = (a.head_dim, a.rope.theta, scaling)
        if key not in self._rotaries:
            self._rotaries[key] = RotaryEmbedding(a.head_dim, self.max_positions, a.rope.theta,
                                                  a.rope.scaling, backend=self.backend,
                                                  device=self.device)
        return self._rotaries[key]

    def build_attention(self, i: int, *, qk_norm_eps: float | None,
                        qk_norm_unit_offset: bool = False,
                        v_norm_eps: float | None = None) -> Attention:
        """Layer ``i``'s attention from its ``LayerAttention``: head size, KV heads, window,
        softmax scale, rotary table, KV group, and whether it computes K/V of its own."""
        spec, a = self.spec, self.layer_attention[i]
        return Attention(spec.hidden_size, spec.num_heads, a.num_kv_heads, a.head_dim,
                         self.rotary_for(a), bias=spec.attention_bias or spec.qkv_bias,
                         o_bias=spec.attention_bias, qk_norm_eps=qk_norm_eps,
                         lora=self.lora_config, scale=a.scale, window=a.window,
                         has_kv=a.is_producer, qk_norm_unit_offset=qk_norm_unit_offset,
                         v_norm_eps=v_norm_eps, kv_group=self.layer_group[i], **self._kw(),
                         tp=self.tp)

    # ---- compute ----

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states of every token row [T, H]."""
        groups = batch.lora.groups if batch.lora is not None else None
        x = self.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch.positions, batch.attn, groups)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        """[N, H] -> fp32 [N, V] (the head GEMM runs in the model dtype, as HF's does).

        ``upcast=False`` returns the GEMM's output as it is, in the model dtype: the fp32
        logits are its exact upcast, so a consumer that reads it directly skips an [N, V]
        fp32 copy.
        """
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = vocab_parallel_logits(self.backend, self.tp, hidden, head,
                                       self.spec.vocab_size)
        return logits.float() if upcast else logits

    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: KVCache | Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        *,
        upcast: bool = True,
    ) -> torch.Tensor:
        """fp32 next-token logits of the rows ``batch.logits_indices``: [N, V].

        ``kv_caches`` (per layer ``(k_cache, v_cache)``) is bound first when given; without it
        the pages bound last (``allocate_kv_cache`` / ``bind_kv_cache``) are used.
        ``upcast=False``: the logits in the model dtype (see ``compute_logits``).
        """
        if kv_caches is not None:
            self.bind_kv_cache(kv_caches)
        h = self.hidden_states(batch)
        return self.compute_logits(h.index_select(0, batch.logits_indices), upcast=upcast)

    def position_offset(self, length: int) -> int:
        """What the engine adds to the positions of a sequence whose tokens reach ``length``:
        the row offset of its rotary table (LongRoPE's long factors past
        original_max_position_embeddings; else 0). A sequence whose offset changes as it
        grows is recomputed (``position_offsets_vary``)."""
        return longrope_position_offset(self.spec.rope_scaling, self.max_positions, length)

    @property
    def position_offsets_vary(self) -> bool:
        """Whether ``position_offset`` is ever nonzero (LongRoPE beyond its original
        context); when not, the engine never asks."""
        return longrope_offsets_vary(self.spec.rope_scaling, self.max_positions)

    # ---- KV cache ----

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads whose pages this rank holds (all of them on one rank), of layer 0."""
        return self.layers[0].self_attn.num_kv_heads

    @property
    def uniform_kv(self) -> bool:
        """One group of full-attention layers that all keep their own K/V of one shape."""
        return len(self.kv_groups) == 1 and self.kv_groups[0].window is None \
            and len(self.kv_groups[0].layers) == self.spec.num_layers \
            and len({(lp.num_kv_heads, lp.head_dim) for lp in self.layer_pages()}) == 1

    def layer_pages(self) -> list[LayerPages]:
        """Where each layer's K/V live (its group and page shape here, or its producer)."""
        out = []
        for i, layer in enumerate(self.layers):
            attn, a = layer.self_attn, self.layer_attention[i]
            out.append(LayerPages(self.layer_group[i], attn.num_kv_heads, attn.head_dim,
                                  a.kv_source))
        return out

    def kv_page_bytes(self, block_size: int) -> tuple[int, ...]:
        """Bytes of one page of each KV group on this rank (its KV heads only)."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        sizes = [0] * len(self.kv_groups)
        for lp in self.layer_pages():
            if lp.source is None:
                sizes[lp.group] += 2 * block_size * lp.num_kv_heads * lp.head_dim * elem
        return tuple(sizes)

    def kv_cache_bytes_per_token(self) -> int:
        """K and V of one token over every layer with a cache of its own, in bytes, for the
        KV heads held here."""
        return sum(self.kv_page_bytes(1))

    def allocate_kv_cache(self, num_blocks: int | Sequence[int], block_size: int) -> KVCache:
        """Allocate and bind the pages: ``num_blocks`` per KV group, or one count for every
        group (a throw-away cache for profiling)."""
        blocks = [num_blocks] * len(self.kv_groups) if isinstance(num_blocks, int) \
            else list(num_blocks)
        if len(blocks) != len(self.kv_groups):
            raise ValueError(f"the model keeps its KV pages in {len(self.kv_groups)} groups, "
                             f"got page counts {blocks}")
        device = self.embed_tokens.weight.device
        if self.uniform_kv:
            kv = KVCache.allocate(self.spec, blocks[0], block_size, dtype=self.dtype,
                                  device=device, num_kv_heads=self.num_local_kv_heads)
        else:
            kv = KVCache.allocate_layers(self.layer_pages(), blocks, block_size,
                                         dtype=self.dtype, device=device)
        self.bind_kv_cache(kv)
        return kv

    def bind_kv_cache(
        self, kv: KVCache | Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Point every attention layer at its pages: a KVCache or per-layer (k, v) pairs."""
        pairs = list(kv)
        if len(pairs) != self.spec.num_layers:
            raise ValueError(f"KV cache has {len(pairs)} layers, the model {self.spec.num_layers}")
        for layer, (k, v) in zip(self.layers, pairs, strict=True):
            layer.self_attn.bind_kv_cache(k, v)

    def release_kv_cache(self) -> None:
        """Unbind every attention layer's pages (an engine shutting down frees them)."""
        for layer in self.layers:
            layer.self_attn.release_kv_cache()

    # ---- checkpoint and adapter mapping ----

    embedding_weight_name = "model.embed_tokens.weight"  # the tied LM head's twin

    def skipped_weight(self, name: str) -> str | None:
        """Why checkpoint weight ``name``, which the model does not use, is left out (a
        phrase for the log), or None: it must then be one of ``hf_weights``."""
        del name
        return None

    def hf_weights(self) -> dict[str, WeightSlot]:
        """Every weight a Hugging Face checkpoint of this model must hold, by HF name."""
        s = self.spec
        out: dict[str, WeightSlot] = {
            "model.embed_tokens.weight": ((s.vocab_size, s.hidden_size),
                                          self.embed_tokens.load_weight),
            "model.norm.weight": ((s.hidden_size,), self.norm.load_weight),
        }
        if self.lm_head is not None:
            out["lm_head.weight"] = ((s.vocab_size, s.hidden_size), self.lm_head.load_weight)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            out[p + "input_layernorm.weight"] = ((s.hidden_size,),
                                                 layer.input_layernorm.load_weight)
            out[p + "post_attention_layernorm.weight"] = (
                (s.hidden_size,), layer.post_attention_layernorm.load_weight)
            _add_linear(out, p + "self_attn.", QKV_MODULES, attn.qkv_proj)
            _add_linear(out, p + "self_attn.", ("o_proj",), attn.o_proj)
            _add_linear(out, p + "mlp.", GATE_UP_MODULES, mlp.gate_up_proj)
            _add_linear(out, p + "mlp.", ("down_proj",), mlp.down_proj)
            if attn.q_norm is not None and attn.k_norm is not None:
                out[p + "self_attn.q_norm.weight"] = ((s.head_dim,), attn.q_norm.load_weight)
                out[p + "self_attn.k_norm.weight"] = ((s.head_dim,), attn.k_norm.load_weight)
            for fused, parts in self.fused_modules.items():
                _fuse_weights(out, p, fused, parts, self._linear_of(layer, parts[0]))
        return out

    @staticmethod
    def _linear_of(layer: DecoderLayer, name: str) -> LinearBase:
        """The fused layer that holds slice ``name`` ("self_attn.q_proj", "mlp.up_proj")."""
        if name.startswith("self_attn."):
            return layer.self_attn.qkv_proj
        return layer.mlp.gate_up_proj

    def lora_linears(self) -> list[tuple[LinearBase, tuple[str, ...]]]:
        """Each linear with LoRA slots and the PEFT module names of its slices."""
        if self.lora_config is None:
            return []
        out: list[tuple[LinearBase, tuple[str, ...]]] = []
        for i, layer in enumerate(self.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            out.append((layer.self_attn.qkv_proj, tuple(a + n for n in QKV_MODULES)))
            out.append((layer.self_attn.o_proj, (a + "o_proj",)))
            out.append((layer.mlp.gate_up_proj, tuple(m + n for n in GATE_UP_MODULES)))
            out.append((layer.mlp.down_proj, (m + "down_proj",)))
        return out

    def lora_target_shapes(self) -> dict[str, tuple[int, int]]:
        """PEFT module name -> (in_features, out_features) of every LoRA target."""
        shapes: dict[str, tuple[int, int]] = {}
        s = self.spec
        for i in range(s.num_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            shapes |= {a + "q_proj": (s.hidden_size, s.q_size),
                       a + "k_proj": (s.hidden_size, s.kv_size),
                       a + "v_proj": (s.hidden_size, s.kv_size),
                       a + "o_proj": (s.q_size, s.hidden_size),
                       m + "gate_proj": (s.hidden_size, s.intermediate_size),
                       m + "up_proj": (s.hidden_size, s.intermediate_size),
                       m + "down_proj": (s.intermediate_size, s.hidden_size)}
            p = f"model.layers.{i}."
            for fused, parts in self.fused_modules.items():
                sizes = [shapes[p + part] for part in parts]
                shapes[p + fused] = (sizes[0][0], sum(out for _, out in sizes))
        return shapes

    def lora_fused_targets(self) -> dict[str, tuple[str, ...]]:
        """PEFT module name of a fused HF module -> the module names of its slices, in row
        order (Phi-3: qkv_proj -> q_proj, k_proj, v_proj); empty where HF's modules are ours."""
        return {f"model.layers.{i}.{fused}": tuple(f"model.layers.{i}.{p}" for p in parts)
                for i in range(self.spec.num_layers)
                for fused, parts in self.fused_modules.items()}

    def weights_hash(self) -> str:
        """Hash of the loaded weights (as converted to the model dtype) and the spec."""
        if self._weights_hash is None:
            raise ValueError("weights_hash is known once weights are loaded (use load_model)")
        return self._weights_hash

    def set_weights_hash(self, value: str) -> None:
        self._weights_hash = value


def _add_linear(
    out: dict[str, WeightSlot], prefix: str, names: tuple[str, ...], linear: LinearBase
) -> None:
    for s, name in enumerate(names):
        shape = (linear.output_sizes[s], linear.input_size)
        out[f"{prefix}{name}.weight"] = (shape, _slice_loader(linear.load_weight, s))
        if linear.bias is not None:
            out[f"{prefix}{name}.bias"] = ((linear.output_sizes[s],),
                                           _slice_loader(linear.load_bias, s))


def _fuse_weights(out: dict[str, WeightSlot], prefix: str, fused: str,
                  parts: tuple[str, ...], linear: LinearBase) -> None:
    """Replace the weights of ``parts`` (every slice of ``linear``, in order) by the one fused
    checkpoint weight (and bias) that holds them in row order."""
    assert len(parts) == len(linear.output_sizes), (parts, linear.output_sizes)
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{part}.{kind}" for part in parts]
        if keys[0] not in out:
            continue
        shapes = [out.pop(key)[0] for key in keys]
        rows = [shape[0] for shape in shapes]
        load = linear.load_weight if kind == "weight" else linear.load_bias

        def split_load(t: torch.Tensor, load=load, rows=rows) -> None:
            for s, part in enumerate(t.split(rows, dim=0)):
                load(part, s)

        out[f"{prefix}{fused}.{kind}"] = ((sum(rows), *shapes[0][1:]), split_load)


def _slice_loader(
    fn: Callable[[torch.Tensor, int], None], slice_index: int
) -> Callable[[torch.Tensor], None]:
    return lambda t: fn(t, slice_index)
