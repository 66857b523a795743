"""Self-attention over a paged KV cache: fused q/k/v projection, optional per-head q/k
RMSNorm (Qwen3, Gemma) and weightless V norm (Gemma 4), rotary (or none: Nemotron-H), KV
write into the pages, paged attention (full causal or a sliding window), output projection.

A layer that reads an earlier layer's K/V (Gemma 4's KV-shared layers, ``has_kv=False``)
projects only q and attends over the pages bound to it, the producer's. ``kv_group`` names
the group of KV pages (models/layer_spec.py) whose slots and block tables it uses."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from detlora.distributed.group import TensorParallelGroup
from detlora.distributed.sharding import even_shard, kv_head_shard
from detlora.layers.backend import OpBackend
from detlora.layers.lora_slots import LoRAConfig
from detlora.layers.norm import RMSNorm
from detlora.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from detlora.layers.rotary import RotaryEmbedding
from detlora.ops.adapter_groups import AdapterGroups

if TYPE_CHECKING:  # the contract lives in models/; layers only read it
    from detlora.layers.forward_batch import AttentionMetadata


class Attention(nn.Module):
    """``num_heads`` query and ``num_kv_heads`` KV heads of the whole layer; with a
    tensor-parallel group, this rank computes its share of them (heads are independent, so
    their bits do not depend on the split): q|k|v column-parallel, o row-parallel."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding | None,
        *,
        backend: OpBackend,
        bias: bool = False,
        o_bias: bool | None = None,
        qk_norm_eps: float | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        lora: LoRAConfig | None = None,
        tp: TensorParallelGroup | None = None,
        scale: float | None = None,
        window: int | None = None,
        has_kv: bool = True,
        qk_norm_unit_offset: bool = False,
        v_norm_eps: float | None = None,
        kv_group: int = 0,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
            )
        tp = tp or TensorParallelGroup.single()
        self.backend = backend
        q_heads = even_shard(num_heads, tp.rank, tp.size)
        kv_heads = kv_head_shard(num_kv_heads, tp.rank, tp.size)
        # Heads held here (all of them on one rank).
        self.num_heads = q_heads[1] - q_heads[0]
        self.num_kv_heads = kv_heads[1] - kv_heads[0]
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.window = window
        self.has_kv = has_kv
        self.kv_group = kv_group
        common = dict(backend=backend, bias=bias, dtype=dtype, device=device, lora=lora, tp=tp)
        q_rows = (q_heads[0] * head_dim, q_heads[1] * head_dim)
        kv_rows = (kv_heads[0] * head_dim, kv_heads[1] * head_dim)
        full_kv = num_kv_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(
            hidden_size, (num_heads * head_dim, full_kv, full_kv) if has_kv else
            (num_heads * head_dim,), shards=(q_rows, kv_rows, kv_rows) if has_kv else
            (q_rows,), **common)
        # ``bias`` is q/k/v's, ``o_bias`` o_proj's (None: the same; False: q/k/v only).
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size,
                                        **{**common, "bias": bias if o_bias is None else o_bias})
        self.rotary = rotary
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        self.v_norm: RMSNorm | None = None
        norm = dict(backend=backend, dtype=dtype, device=device)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=qk_norm_unit_offset,
                                  **norm)
            if has_kv:
                self.k_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=qk_norm_unit_offset,
                                      **norm)
        if v_norm_eps is not None and has_kv:
            self.v_norm = RMSNorm(head_dim, v_norm_eps, with_weight=False, **norm)
        # Pages [num_blocks, block_size, Hk, D], owned by the engine and bound before use;
        # plain attributes, not buffers: the cache is neither a weight nor moved with .to().
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        expected = (self.num_kv_heads, self.head_dim)
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.dim() != 4 or tuple(c.shape[2:]) != expected:
                raise ValueError(
                    f"{name} must have shape [num_blocks, block_size, {expected[0]}, "
                    f"{expected[1]}], got {tuple(c.shape)}"
                )
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache "
                             f"{tuple(v_cache.shape)} must have the same shape")
        self.k_cache, self.v_cache = k_cache, v_cache

    def release_kv_cache(self) -> None:
        """Drop the pages (the memory is freed once nothing else holds them)."""
        self.k_cache = self.v_cache = None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        lora: AdapterGroups | None = None,
    ) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise ValueError("no KV cache bound: call bind_kv_cache (or the model's) first")
        attn = attn.for_group(self.kv_group)
        t = x.shape[0]
        qkv, pending = self.qkv_proj.forward_unexpanded(x, lora)
        if not self.has_kv:  # q only: K/V are the producer's, already in the pages
            if pending is not None:
                qkv = self.backend.lora_expand(qkv, pending.shrink_out, pending.lora_b, lora,
                                               pending.slice_offsets,
                                               slot_ranks=pending.slot_ranks)
            q = qkv.reshape(t, self.num_heads, self.head_dim)
            if self.q_norm is not None:
                q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads,
                                                                   self.head_dim)
            # Rotary rotates q and k alike, head by head: a one-head view of q stands in for
            # the k it needs (its rotation is dropped).
            q, _ = self.backend.rotary(q, q[:, :1], positions, self.rotary.cos_sin)
            return self._attend(q, attn, lora)
        if pending is not None and self.q_norm is None and self.v_norm is None \
                and self.rotary is not None:
            # The q|k|v expand fused into rotary and the KV write: one launch, the same bits.
            q = self.backend.expand_rotate_and_write_kv(
                qkv, pending.shrink_out, pending.lora_b, lora, pending.slice_offsets, positions,
                self.rotary.cos_sin, self.k_cache, self.v_cache, attn.slot_mapping,
                slot_ranks=pending.slot_ranks)
            return self._attend(q, attn, lora)
        if pending is not None:  # q/k norms sit between the expand and rotary
            qkv = self.backend.lora_expand(qkv, pending.shrink_out, pending.lora_b, lora,
                                           pending.slice_offsets, slot_ranks=pending.slot_ranks)
        if self.q_norm is not None and self.k_norm is not None:  # every q and k head, in place
            qkv = self.backend.qk_rms_norm(qkv, self.q_norm.weight, self.k_norm.weight,
                                           self.q_norm.eps, self.num_heads, self.num_kv_heads,
                                           self.head_dim)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)  # strided rows: write_kv takes them
        if self.v_norm is not None:
            v = self.v_norm(v.reshape(-1, self.head_dim)).view(t, self.num_kv_heads,
                                                               self.head_dim)
        if self.rotary is None:  # no position embedding: k and v go into the pages as they are
            self.backend.write_kv(k, v, self.k_cache, self.v_cache, attn.slot_mapping)
            return self._attend(q.contiguous(), attn, lora)
        # Reads strided rows; q comes back contiguous, k and v go into the pages.
        q = self.rotary.rotate_and_write_kv(q, k, v, positions, self.k_cache, self.v_cache,
                                            attn.slot_mapping)
        return self._attend(q, attn, lora)

    def _attend(self, q: torch.Tensor, attn: AttentionMetadata,
                lora: AdapterGroups | None) -> torch.Tensor:
        """Paged attention of the rotated q over the pages, then the output projection."""
        if self.window is None:
            o = self.backend.paged_attention(
                q, self.k_cache, self.v_cache, attn.block_tables, attn.seq_lens,
                attn.query_start_loc, self.scale, max_query_len=attn.max_query_len,
            )
        else:
            o = self.backend.paged_attention(
                q, self.k_cache, self.v_cache, attn.block_tables, attn.seq_lens,
                attn.query_start_loc, self.scale, max_query_len=attn.max_query_len,
                window=self.window,
            )
        return self.o_proj(o.reshape(q.shape[0], self.q_size), lora)

    def extra_repr(self) -> str:
        extra = "" if self.window is None else f", window={self.window}"
        if not self.has_kv:
            extra += ", reads another layer's K/V"
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, qk_norm={self.q_norm is not None}{extra}")
