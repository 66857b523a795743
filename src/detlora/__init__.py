"""detlora: bit-reproducible LLM inference with LoRA adapters."""

from detlora.batch_invariant import (
    batch_invariant,
    disable_batch_invariant_mode,
    enable_batch_invariant_mode,
    is_batch_invariant_mode_enabled,
)
from detlora.config import Determinism, LoRAReduction, SamplingParams
from detlora.engine.llm import LLM
from detlora.engine.outputs import CompletionOutput, RequestOutput
from detlora.lora.request import LoRARequest

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "Determinism",
    "LoRAReduction",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "__version__",
    "batch_invariant",
    "disable_batch_invariant_mode",
    "enable_batch_invariant_mode",
    "is_batch_invariant_mode_enabled",
]
