"""The study's default adapter: rank 16 on all seven projections, seeded, non-zero A and B;
and the rank of a user's adapter.

A has entries of scale 1/sqrt(in) (x A^T of a normalised input is O(1)) and B of scale
``B_STD``: small enough to leave the base model's answers mostly intact, large enough that
the LoRA term reaches the outputs' bits.
"""

from __future__ import annotations

import json
from pathlib import Path

from detlora.entrypoints.demo import write_random_adapter

RANK = 16
B_STD = 0.01


def write_default_adapter(model_dir: str | Path, out_dir: str | Path, *, rank: int = RANK,
                          seed: int = 0) -> Path:
    """Write the adapter (alpha = 2 x rank) for the model in ``model_dir``; returns it."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    out = Path(out_dir)
    write_random_adapter(out, Path(model_dir), rank=rank, seed=seed, b_std=B_STD)
    return out


def adapter_rank(adapter_dir: str | Path) -> int:
    """``r`` of a PEFT adapter directory (the largest of its rank_pattern too)."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"adapter directory {adapter_dir} has no adapter_config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    ranks = [cfg.get("r"), *(cfg.get("rank_pattern") or {}).values()]
    ranks = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r > 0]
    if not ranks:
        raise ValueError(f"{path} names no positive rank r")
    return max(ranks)
