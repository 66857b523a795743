"""What a model's layers need where they differ from one another: each layer's attention
(sliding window or full, head size, softmax scale, rotary table, the layer whose K/V it
reads) and the groups of KV-cache pages that follow from it.

A model with uniform layers (Llama, Qwen3) leaves ``ModelSpec.layer_attention`` unset and
every layer gets ``LayerAttention.uniform(spec)``. Any model can set a window on a layer:
the KV cache then keeps only the pages of that layer's window (engine/sched), and the
attention kernels start each query's visit at its window (ops/paged_attention.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: base ``theta`` and a scaling (None; or ``rope_type`` "llama3",
    "linear" with ``factor``, or "proportional" with ``partial_rotary_factor``: Gemma 4's
    full layers, where only the first ``partial * head_dim / 2`` frequencies turn)."""

    theta: float
    scaling: Mapping[str, Any] | None = None

    def canonical(self) -> dict[str, Any]:
        return {"theta": self.theta,
                "scaling": dict(self.scaling) if self.scaling is not None else None}


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention."""

    head_dim: int
    num_kv_heads: int
    rope: RopeSpec
    window: int | None = None  # keys a query sees, its own included; None: every earlier one
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    kv_source: int | None = None  # the earlier layer whose cached K/V it reads; None: its own

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    @property
    def is_producer(self) -> bool:
        """Whether the layer computes and caches K/V of its own."""
        return self.kv_source is None

    def canonical(self) -> dict[str, Any]:
        return {"head_dim": self.head_dim, "num_kv_heads": self.num_kv_heads,
                "rope": self.rope.canonical(), "window": self.window, "scale": self.scale,
                "kv_source": self.kv_source}


@dataclass(frozen=True)
class KVGroup:
    """Layers whose KV pages are handed out together: one block table per sequence serves
    them all. Layers of one group share a window (None: full attention, every page kept);
    their page shapes may differ (head sizes, KV heads)."""

    window: int | None
    layers: tuple[int, ...]  # producer layers, in order


def kv_groups(attention: Sequence[LayerAttention]) -> tuple[KVGroup, ...]:
    """The page groups of a model's layers: one per distinct window over the producer
    layers, full attention first (it holds the most pages), then windows ascending."""
    by_window: dict[int | None, list[int]] = {}
    for i, a in enumerate(attention):
        if a.is_producer:
            by_window.setdefault(a.window, []).append(i)
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return tuple(KVGroup(w, tuple(by_window[w])) for w in order)


def check_layer_attention(attention: Sequence[LayerAttention], source: str) -> None:
    """Every KV source is an earlier producer with the same window, head size and KV heads."""
    for i, a in enumerate(attention):
        if a.window is not None and a.window < 1:
            raise ValueError(f"{source}: layer {i} has window {a.window}; it must be >= 1")
        if a.kv_source is None:
            continue
        j = a.kv_source
        if not 0 <= j < i or not attention[j].is_producer:
            raise ValueError(f"{source}: layer {i} reads the K/V of layer {j}, which is not "
                             "an earlier layer with a cache of its own")
        p = attention[j]
        if (p.window, p.head_dim, p.num_kv_heads) != (a.window, a.head_dim, a.num_kv_heads):
            raise ValueError(f"{source}: layer {i} reads the K/V of layer {j}, whose window, "
                             "head_dim or KV heads differ")


def frozen_mapping(d: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    return None if d is None else MappingProxyType(dict(d))
