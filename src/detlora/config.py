"""Engine-wide settings: determinism levels and LoRA reduction choices.

Frozen dataclasses and string enums only; nothing here imports torch kernels, so the CLI and
tests can read settings without touching the GPU.
"""

from __future__ import annotations

from enum import Enum


class Determinism(str, Enum):
    """What the engine promises about the bits of an output (DESIGN.md, "Determinism levels")."""

    FAST = "fast"  # no promise: atomic Split-K, vendor GEMMs
    RUN_TO_RUN = "run_to_run"  # same batch, same bits
    BATCH_INVARIANT = "batch_invariant"  # same request, same bits, whatever the batch

    @classmethod
    def parse(cls, value: str | Determinism) -> Determinism:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(level.value) for level in cls)
            raise ValueError(f"determinism must be one of {names}, got {value!r}") from None


class LoRAReduction(str, Enum):
    """How the LoRA shrink sums over the hidden axis.

    ``ordered_bi`` is ``ordered`` with a split count and BLOCK_K fixed per (H, r): a row's bits
    do not depend on how many rows share the call.
    """

    ATOMIC = "atomic"
    UNSPLIT = "unsplit"
    ORDERED = "ordered"
    ORDERED_BI = "ordered_bi"
    TREE = "tree"

    @classmethod
    def parse(cls, value: str | LoRAReduction) -> LoRAReduction:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(r.value) for r in cls)
            raise ValueError(f"reduction must be one of {names}, got {value!r}") from None


# The reduction each level uses unless ``lora_reduction`` overrides it.
DEFAULT_LORA_REDUCTION: dict[Determinism, LoRAReduction] = {
    Determinism.FAST: LoRAReduction.ATOMIC,
    Determinism.RUN_TO_RUN: LoRAReduction.ORDERED,
    Determinism.BATCH_INVARIANT: LoRAReduction.ORDERED_BI,
}
