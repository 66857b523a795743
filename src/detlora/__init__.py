"""detlora: bit-reproducible LLM inference with LoRA adapters."""

from importlib import metadata as _metadata

from detlora.batch_invariant import (
    batch_invariant,
    disable_batch_invariant_mode,
    enable_batch_invariant_mode,
    is_batch_invariant_mode_enabled,
)
from detlora.config import Determinism, LogprobsMode, LoRAReduction, SamplingParams
from detlora.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from detlora.engine_args import EngineArgs
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

try:
    __version__ = _metadata.version("detlora")
except _metadata.PackageNotFoundError:  # run from a source tree (PYTHONPATH=src)
    __version__ = "0+source"
__all__ = [
    "LLM",
    "CompletionOutput",
    "Determinism",
    "EngineArgs",
    "LoRAReduction",
    "LoRARequest",
    "Logprob",
    "LogprobsMode",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "__version__",
    "batch_invariant",
    "disable_batch_invariant_mode",
    "enable_batch_invariant_mode",
    "is_batch_invariant_mode_enabled",
]
