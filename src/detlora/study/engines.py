"""The engines a study builds: one per configuration, and a few variants of the engine state.

Every engine serves the same model and adapters with greedy decoding; they differ in level,
LoRA reduction and one engine setting per variant:

* ``main``: CUDA graphs on a GPU, no prefix cache, ``max_num_seqs`` = the study's largest batch;
* ``chunked``: a token budget per step of ``plan.chunk_tokens``, so prefills come in chunks;
* ``preempt``: a KV cache for a quarter of the largest batch, so a batch preempts and
  recomputes;
* ``cache``: the prefix cache on (warm after a first run);
* ``eager``: no CUDA graphs (the trace observes every layer from Python).

The variants other than ``main`` run eagerly: under ``batch_invariant`` an eager step gives the
bits a graph replay gives, and below it both the variant and eager execution may move bits.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from detlora import LLM, LoRARequest
from detlora.study.plan import EngineSetup, StudyPlan

VARIANTS = ("main", "chunked", "preempt", "cache", "eager")


@dataclass(frozen=True)
class StudyModel:
    """A model directory under study, with its adapters and what to call them."""

    path: str
    label: str
    adapters: tuple[str, ...]  # PEFT directories; prompt k uses adapter k % len(adapters)
    adapter_label: str
    max_rank: int
    tokenizer: str | None = None  # a tokenizer directory when the model has none
    max_model_len: int = 512

    def lora_requests(self) -> list[LoRARequest]:
        return [LoRARequest(f"adapter{k}", k + 1, path) for k, path in enumerate(self.adapters)]

    def lora_for(self, k: int) -> LoRARequest:
        return self.lora_requests()[k % len(self.adapters)]


def build_llm(model: StudyModel, setup: EngineSetup, plan: StudyPlan, *, variant: str = "main",
              device: str = "auto", engine: Mapping[str, Any] | None = None) -> LLM:
    """The engine of ``setup`` in ``variant``; ``engine``: further ``LLM`` arguments (dtype,
    gpu_memory_utilization, ...), none of those the study sets itself."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    block = 16
    per_seq = -(-model.max_model_len // block)
    kw: dict = {
        "enable_lora": True, "max_loras": len(model.adapters), "max_lora_rank": model.max_rank,
        "determinism": setup.level, "lora_reduction": setup.reduction, "device": device,
        "max_num_seqs": plan.max_batch, "max_model_len": model.max_model_len,
        "max_num_batched_tokens": max(plan.max_num_batched_tokens, model.max_model_len),
        "block_size": block, "num_kv_blocks": plan.max_batch * per_seq + 1,
        "enable_prefix_caching": False, "enforce_eager": variant != "main",
        "seed": plan.seed,
    }
    if model.tokenizer is not None:
        kw["tokenizer"] = model.tokenizer
    clash = sorted(set(engine or {}) & {*kw, "tokenizer", "model"})
    if clash:
        raise ValueError(f"the study sets {clash} itself in every engine it builds")
    if variant == "chunked":
        kw["max_num_batched_tokens"] = plan.chunk_tokens
    elif variant == "preempt":  # room for a quarter of the largest batch, two at least
        kw["num_kv_blocks"] = max(2, plan.max_batch // 4) * per_seq + 1
    elif variant == "cache":
        kw["enable_prefix_caching"] = True
    return LLM(model.path, **{**(engine or {}), **kw})


def release() -> None:
    """Free what dropped engines held (call after dropping the last reference)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
