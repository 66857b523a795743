"""Nemotron-H (NemotronHForCausalLM): a hybrid of Mamba-2, attention and squared-ReLU MLP
layers, one mixer per pre-norm block, in the order of the config's layer pattern (``M``,
``*``, ``-``; MoE ``E`` layers are refused when the config is read).

Embedding (no scaling), the blocks ``h = h + mixer(RMSNorm(h))``, the final ``norm_f`` and an
untied LM head. Attention has no position embedding (no rotary, no q/k norm); the RMSNorms
multiply their weight in fp32, as detlora's RMSNorm does. Checkpoints name the stack
``backbone.*`` (transformers renames it ``model.*`` when it loads; both load here).

The model side of the engine contract is ``DecoderForCausalLM``'s (models/causal_lm.py), plus
the state cache of the Mamba layers: ``allocate_state_cache(num_slots)`` binds one slot per
running sequence to every Mamba layer, and ``ForwardBatch.mamba`` names each sequence's slot
and the step's chunks (``layers/mamba_metadata.py``). Tensor parallelism is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from detlora.distributed.group import TensorParallelGroup
from detlora.layers.attention import Attention
from detlora.layers.backend import OpBackend
from detlora.layers.forward_batch import ForwardBatch
from detlora.layers.linear import LinearBase
from detlora.layers.lora_slots import LoRAConfig
from detlora.layers.mamba_mixer import MambaMixer
from detlora.layers.mixer_block import MixerBlock
from detlora.layers.norm import RMSNorm
from detlora.layers.plain_mlp import PlainMLP
from detlora.layers.vocab_parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from detlora.models.causal_lm import QKV_MODULES, WeightSlot, _add_linear
from detlora.models.hybrid_spec import ATTENTION, MAMBA
from detlora.models.kv_cache import KVCache, LayerPages
from detlora.models.spec import ModelSpec
from detlora.models.state_cache import StateCache, state_bytes_per_slot


class NemotronHForCausalLM(nn.Module):
    architecture: ClassVar[str] = "NemotronHForCausalLM"

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
        if spec.architecture != self.architecture or spec.hybrid is None:
            raise ValueError(f"{type(self).__name__} cannot be built from a "
                             f"{spec.architecture} config")
        self.tp = tp or TensorParallelGroup.single(device or "cpu")
        if not self.tp.is_single:
            raise ValueError("tensor parallelism does not support hybrid (Mamba-2) models "
                             "yet: run NemotronH with tensor_parallel_size=1")
        self.spec = spec
        self.backend = backend
        self.dtype = dtype or spec.dtype
        self.lora_config = lora
        self.max_positions = max_positions or spec.max_position_embeddings
        self._weights_hash: str | None = None
        h = spec.hybrid
        kw = dict(backend=backend, dtype=self.dtype, device=device)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, **kw)
        blocks = []
        for kind in h.layer_types:
            if kind == MAMBA:
                mixer: nn.Module = MambaMixer(
                    spec.hidden_size, num_heads=h.mamba_num_heads, head_dim=h.mamba_head_dim,
                    n_groups=h.n_groups, d_state=h.ssm_state_size, conv_kernel=h.conv_kernel,
                    chunk_size=h.chunk_size, eps=spec.rms_norm_eps, conv_bias=h.conv_bias,
                    proj_bias=h.proj_bias, dt_limit=h.time_step_limit, lora=lora, **kw)
            elif kind == ATTENTION:
                mixer = Attention(spec.hidden_size, spec.num_heads, spec.num_kv_heads,
                                  spec.head_dim, None, bias=spec.attention_bias, lora=lora, **kw)
            else:
                mixer = PlainMLP(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias,
                                 lora=lora, **kw)
            blocks.append(MixerBlock(RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw), mixer))
        self.layers = nn.ModuleList(blocks)
        self.layer_types = h.layer_types
        self.norm_f = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.lm_head: ParallelLMHead | None = (
            None if spec.tie_word_embeddings
            else ParallelLMHead(spec.vocab_size, spec.hidden_size, **kw))
        self._attention = [b.mixer for b, k in zip(self.layers, h.layer_types, strict=True)
                           if k == ATTENTION]
        self._mamba = [b.mixer for b, k in zip(self.layers, h.layer_types, strict=True)
                       if k == MAMBA]

    # ---- compute ----

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states of every token row [T, H]."""
        groups = batch.lora.groups if batch.lora is not None else None
        if batch.mamba is None and self._mamba:
            raise ValueError("a hybrid model's step needs ForwardBatch.mamba (the sequences' "
                             "state slots and chunks)")
        x = self.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        for block, kind in zip(self.layers, self.layer_types, strict=True):
            if kind == MAMBA:
                x, residual = block(x, residual, batch.mamba, groups)
            elif kind == ATTENTION:
                x, residual = block(x, residual, batch.positions, batch.attn, groups)
            else:
                x, residual = block(x, residual, groups)
        x, _ = self.norm_f(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        """[N, H] -> fp32 [N, V] (``upcast=False``: the head GEMM's output, model dtype)."""
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
        """Next-token logits of the rows ``batch.logits_indices`` (as DecoderForCausalLM)."""
        if kv_caches is not None:
            self.bind_kv_cache(kv_caches)
        h = self.hidden_states(batch)
        return self.compute_logits(h.index_select(0, batch.logits_indices), upcast=upcast)

    # ---- KV cache (attention layers) ----

    @property
    def num_local_kv_heads(self) -> int:
        return self.spec.num_kv_heads

    def kv_page_bytes(self, block_size: int) -> tuple[int, ...]:
        """Bytes of one page (of the one KV group): K and V of the attention layers."""
        return (block_size * self.spec.kv_cache_bytes_per_token(self.dtype),)

    def kv_cache_bytes_per_token(self) -> int:
        return self.spec.kv_cache_bytes_per_token(self.dtype)

    def allocate_kv_cache(self, num_blocks: int | Sequence[int], block_size: int) -> KVCache:
        """Pages for the attention layers only (one group of full attention)."""
        blocks = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        if len(blocks) != 1:
            raise ValueError(f"the model keeps its KV pages in one group, got page counts "
                             f"{blocks}")
        s = self.spec
        pages = [LayerPages(0, s.num_kv_heads, s.head_dim)] * len(self._attention)
        kv = KVCache.allocate_layers(pages, blocks, block_size, dtype=self.dtype,
                                     device=self.embed_tokens.weight.device)
        self.bind_kv_cache(kv)
        return kv

    def bind_kv_cache(
        self, kv: KVCache | Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        pairs = list(kv)
        if len(pairs) != len(self._attention):
            raise ValueError(f"KV cache has {len(pairs)} layers, the model "
                             f"{len(self._attention)} attention layers")
        for attn, (k, v) in zip(self._attention, pairs, strict=True):
            attn.bind_kv_cache(k, v)

    def release_kv_cache(self) -> None:
        for attn in self._attention:
            attn.release_kv_cache()
        self.release_state_cache()

    # ---- state cache (Mamba layers) ----

    @property
    def mamba_chunk_size(self) -> int:
        """The chunk grid of every Mamba layer (positions per chunk)."""
        assert self.spec.hybrid is not None
        return self.spec.hybrid.chunk_size

    def state_bytes_per_slot(self) -> int:
        """One sequence's state over all Mamba layers, in bytes."""
        return state_bytes_per_slot(self.spec, self.dtype)

    def allocate_state_cache(self, num_slots: int) -> StateCache:
        cache = StateCache.allocate(self.spec, num_slots, dtype=self.dtype,
                                    device=self.embed_tokens.weight.device)
        self.bind_state_cache(cache)
        return cache

    def bind_state_cache(self, cache: StateCache) -> None:
        for mixer, conv, ssm, chunk in zip(self._mamba, cache.conv, cache.ssm, cache.chunk,
                                           strict=True):
            mixer.bind_state(conv, ssm, chunk)

    def release_state_cache(self) -> None:
        for mixer in self._mamba:
            mixer.release_state()

    # ---- checkpoint and adapter mapping ----

    embedding_weight_name = "model.embeddings.weight"  # the tied LM head's twin

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint tensor's name as ``hf_weights`` spells it (``backbone.*`` ->
        ``model.*``)."""
        if name.startswith("backbone."):
            return "model." + name[len("backbone."):]
        return name

    @staticmethod
    def skipped_weight(name: str) -> str | None:
        """Why a checkpoint weight is left out (multi-token-prediction layers: generation
        does not use them, as in transformers), or None."""
        if name.startswith("mtp."):
            return "multi-token-prediction (mtp.*) weights, unused for generation"
        return None

    def hf_weights(self) -> dict[str, WeightSlot]:
        """Every weight a checkpoint of this model must hold, by (transformers') name."""
        s = self.spec
        out: dict[str, WeightSlot] = {
            "model.embeddings.weight": ((s.vocab_size, s.hidden_size),
                                        self.embed_tokens.load_weight),
            "model.norm_f.weight": ((s.hidden_size,), self.norm_f.load_weight),
        }
        if self.lm_head is not None:
            out["lm_head.weight"] = ((s.vocab_size, s.hidden_size), self.lm_head.load_weight)
        for i, (block, kind) in enumerate(zip(self.layers, self.layer_types, strict=True)):
            p = f"model.layers.{i}."
            out[p + "norm.weight"] = ((s.hidden_size,), block.norm.load_weight)
            m, pm = block.mixer, p + "mixer."
            if kind == MAMBA:
                _add_linear(out, pm, ("in_proj",), m.in_proj)
                _add_linear(out, pm, ("out_proj",), m.out_proj)
                out[pm + "conv1d.weight"] = ((m.conv_dim, 1, m.conv_kernel), m.load_conv_weight)
                if m.conv_bias is not None:
                    out[pm + "conv1d.bias"] = ((m.conv_dim,), m.load_conv_bias)
                out[pm + "A_log"] = ((m.num_heads,), m.load_a_log)
                out[pm + "D"] = ((m.num_heads,), m.load_d)
                out[pm + "dt_bias"] = ((m.num_heads,), m.load_dt_bias)
                out[pm + "norm.weight"] = ((m.d_inner,), m.load_norm_weight)
            elif kind == ATTENTION:
                _add_linear(out, pm, QKV_MODULES, m.qkv_proj)
                _add_linear(out, pm, ("o_proj",), m.o_proj)
            else:
                _add_linear(out, pm, ("up_proj",), m.up_proj)
                _add_linear(out, pm, ("down_proj",), m.down_proj)
        return out

    def lora_linears(self) -> list[tuple[LinearBase, tuple[str, ...]]]:
        """Each linear with LoRA slots and the PEFT module names of its slices."""
        if self.lora_config is None:
            return []
        out: list[tuple[LinearBase, tuple[str, ...]]] = []
        for i, (block, kind) in enumerate(zip(self.layers, self.layer_types, strict=True)):
            m, p = block.mixer, f"model.layers.{i}.mixer."
            if kind == MAMBA:
                out += [(m.in_proj, (p + "in_proj",)), (m.out_proj, (p + "out_proj",))]
            elif kind == ATTENTION:
                out += [(m.qkv_proj, tuple(p + n for n in QKV_MODULES)),
                        (m.o_proj, (p + "o_proj",))]
            else:
                out += [(m.up_proj, (p + "up_proj",)), (m.down_proj, (p + "down_proj",))]
        return out

    def lora_target_shapes(self) -> dict[str, tuple[int, int]]:
        """PEFT module name -> (in_features, out_features) of every LoRA target."""
        shapes: dict[str, tuple[int, int]] = {}
        s = self.spec
        for i, (block, kind) in enumerate(zip(self.layers, self.layer_types, strict=True)):
            m, p = block.mixer, f"model.layers.{i}.mixer."
            if kind == MAMBA:
                shapes |= {p + "in_proj": (s.hidden_size, m.in_proj.output_sizes[0]),
                           p + "out_proj": (m.d_inner, s.hidden_size)}
            elif kind == ATTENTION:
                shapes |= {p + "q_proj": (s.hidden_size, s.q_size),
                           p + "k_proj": (s.hidden_size, s.kv_size),
                           p + "v_proj": (s.hidden_size, s.kv_size),
                           p + "o_proj": (s.q_size, s.hidden_size)}
            else:
                shapes |= {p + "up_proj": (s.hidden_size, s.intermediate_size),
                           p + "down_proj": (s.intermediate_size, s.hidden_size)}
        return shapes

    def lora_fused_targets(self) -> dict[str, tuple[str, ...]]:
        """No HF module of NemotronH spans several of ours: empty."""
        return {}

    def position_offset(self, length: int) -> int:
        """No position embedding: positions are what they are (DecoderForCausalLM's offset
        is LongRoPE's)."""
        del length
        return 0

    @property
    def position_offsets_vary(self) -> bool:
        return False

    def weights_hash(self) -> str:
        if self._weights_hash is None:
            raise ValueError("weights_hash is known once weights are loaded (use load_model)")
        return self._weights_hash

    def set_weights_hash(self, value: str) -> None:
        self._weights_hash = value
