"""Each layer's sliding window as the model builds its attention with it (Mistral, Qwen2,
Qwen3, Phi-3: ``ModelSpec.layer_windows``, read from config.json as transformers reads it).

A layer with window w lets the query at position p see keys j with p - w < j <= p
(transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - w``, w keys, its own
included; the paged kernels' ``window`` means the same). Over a sequence of at most
``max_positions`` tokens that is every earlier key exactly when ``max_positions <= w``: such
a window is full attention bit for bit and is dropped, so the layer keeps every page in the
one plain KV group. A shorter window is the layer's ``LayerAttention.window``: the paged KV
cache keeps only its pages (models/layer_spec.py, engine/sched) and the attention kernels
start each query's visit at its window (ops/paged_attention.py).
"""

from __future__ import annotations

from detlora.models.spec import ModelSpec


def attention_windows(spec: ModelSpec, max_positions: int) -> tuple[int | None, ...]:
    """Per layer, the window the layer applies when sequences hold at most
    ``max_positions`` tokens: config.json's window where it is shorter than that, else None
    (full attention gives the same bits)."""
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    windows = spec.layer_windows or (None,) * spec.num_layers
    return tuple(None if w is None or w >= max_positions else w for w in windows)
