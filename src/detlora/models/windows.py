"""Which layers' sliding windows change results at a given context length, and the refusal
of those until the paged KV cache implements windows.

A layer with window w lets the query at position p see keys j with p - w < j <= p
(transformers' ``sliding_window_overlay``). Over a sequence of at most ``max_positions``
tokens that is every earlier key exactly when ``max_positions <= w``: the window is then
full attention, bit for bit. A shorter window is refused by name, never run as full
attention. The per-layer result is what the model builds each attention layer with; a
window that matters becomes a layer parameter once the attention takes one.
"""

from __future__ import annotations

from detlora.models.spec import ModelSpec


def attention_windows(spec: ModelSpec, max_positions: int) -> tuple[None, ...]:
    """Per layer, the window the layer must apply at ``max_positions`` (None: full attention
    is exact). Raises ValueError naming the fields when a window is shorter than the context
    the engine allows."""
    windows = spec.layer_windows or (None,) * spec.num_layers
    short = [(i, w) for i, w in enumerate(windows) if w is not None and w < max_positions]
    if short:
        sizes = sorted({w for _, w in short})
        layers = [i for i, _ in short]
        which = ("every layer" if len(layers) == spec.num_layers
                 else f"layers {_ranges(layers)} of {spec.num_layers}")
        raise ValueError(
            f"{spec.architecture}: config.json's sliding_window={sizes[0]} (on {which}, from "
            "sliding_window / use_sliding_window / max_window_layers / layer_types) is shorter "
            f"than the context this engine allows (max_model_len={max_positions}), and "
            "sliding-window attention is not implemented yet. With max_model_len <= "
            f"{sizes[0]} every window holds the whole sequence and full attention is exact: "
            f"pass max_model_len={sizes[0]} (or less) to run it.")
    return (None,) * spec.num_layers


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)
