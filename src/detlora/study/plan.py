"""How big a study is, and which engine configurations it compares.

``StudyPlan.full()`` is sized for a GPU run of a few minutes per model (the engines' start-up,
CUDA graph capture included, is a large part of it: one engine per configuration and three
variants per level); ``StudyPlan.quick()`` for a minute on a CPU with a tiny model (SmolLM2:
about ten).

A configuration is a determinism level with a LoRA reduction: ``fast`` with ``atomic`` (its
default), ``run_to_run`` with every deterministic reduction the engine offers,
``batch_invariant`` with the batch-invariant ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from detlora import Determinism, LoRAReduction

SECTIONS = ("replay", "repeat", "cross_batch", "decisions", "trace", "performance")

# The reductions whose shrink gives a row the same bits whatever shares its call.
BATCH_INVARIANT_REDUCTIONS = (LoRAReduction.ORDERED_BI, LoRAReduction.IN_GEMM)


@dataclass(frozen=True)
class EngineSetup:
    """One engine configuration of the study: a level and the reduction it runs."""

    level: str
    reduction: str

    @property
    def name(self) -> str:
        return f"{self.level}/{self.reduction}"


# What each level runs when no reduction is asked for (the engine's defaults).
LEVEL_DEFAULTS = {
    Determinism.FAST.value: LoRAReduction.ATOMIC.value,
    Determinism.RUN_TO_RUN.value: LoRAReduction.IN_GEMM.value,
    Determinism.BATCH_INVARIANT.value: LoRAReduction.IN_GEMM.value,
}


def study_setups(reductions: tuple[str, ...] | None = None) -> list[EngineSetup]:
    """Every configuration, optionally limited to ``reductions`` (the levels' defaults stay:
    the cross-batch section runs on them)."""
    allowed = None if reductions is None else {LoRAReduction.parse(r).value for r in reductions}
    out = [EngineSetup(Determinism.FAST.value, LoRAReduction.ATOMIC.value)]
    out += [EngineSetup(Determinism.RUN_TO_RUN.value, r.value) for r in LoRAReduction
            if r is not LoRAReduction.ATOMIC]
    out += [EngineSetup(Determinism.BATCH_INVARIANT.value, r.value)
            for r in BATCH_INVARIANT_REDUCTIONS]
    return [c for c in out if allowed is None or c.reduction in allowed
            or LEVEL_DEFAULTS[c.level] == c.reduction]


def is_level_default(setup: EngineSetup) -> bool:
    return LEVEL_DEFAULTS[setup.level] == setup.reduction


@dataclass(frozen=True)
class StudyPlan:
    prompts: int = 32  # repeat section: tasks per repetition, all in one batch
    repetitions: int = 5  # repeat and decisions: runs compared with the first
    max_tokens: int = 128  # repeat and trace: greedy tokens per generation
    cross_prompts: int = 64  # cross-batch section: prompts run alone and batched
    cross_tokens: int = 32
    cross_batches: tuple[int, ...] = (16, 32, 64)
    comments: int = 64  # decisions: one noul question each
    decision_batches: tuple[int, ...] = (16, 64)  # each compared with the comments alone
    replay_executions: int = 50  # per reduction and shape
    replay_rows: tuple[int, ...] = (1, 16, 64, 256)  # M of the replayed shrinks
    trace_runs: int = 8  # repetitions of the traced batch, at most, to find a divergence
    trace_time_s: float = 45.0  # and seconds, at most
    perf_batches: tuple[int, ...] = (1, 16, 64)
    perf_tokens: int = 64
    perf_trials: int = 2
    chunk_tokens: int = 64  # the chunked-prefill engine's token budget per step
    max_num_batched_tokens: int = 2048  # the other engines'
    seed: int = 0
    grade_workers: int = 8  # sandboxed code checks at once

    def __post_init__(self) -> None:
        for name in ("prompts", "repetitions", "max_tokens", "cross_prompts", "cross_tokens",
                     "comments", "replay_executions", "trace_runs", "perf_tokens", "perf_trials",
                     "chunk_tokens", "max_num_batched_tokens", "grade_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.repetitions < 2:
            raise ValueError(f"repetitions must be >= 2 (runs are compared with the first), "
                             f"got {self.repetitions}")
        if self.replay_executions < 2:
            raise ValueError(f"replay_executions must be >= 2, got {self.replay_executions}")
        if self.perf_tokens < 2:
            raise ValueError(f"perf_tokens must be >= 2, got {self.perf_tokens}")

    @property
    def max_batch(self) -> int:
        """The engines' max_num_seqs: the largest batch any section forms."""
        return max(self.prompts, self.cross_prompts, self.comments, *self.cross_batches,
                   *self.decision_batches, *self.perf_batches)

    @classmethod
    def full(cls) -> StudyPlan:
        return cls()

    @classmethod
    def quick(cls) -> StudyPlan:
        return cls(prompts=6, repetitions=3, max_tokens=10, cross_prompts=6, cross_tokens=8,
                   cross_batches=(3, 6), comments=6, decision_batches=(6,),
                   replay_executions=3, replay_rows=(1, 8), trace_runs=3, trace_time_s=30.0,
                   perf_batches=(1, 6), perf_tokens=4, perf_trials=1, chunk_tokens=8,
                   max_num_batched_tokens=512, grade_workers=2)

    def with_overrides(self, **kw: int | None) -> StudyPlan:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})
