"""detlora: bit-reproducible LLM inference with LoRA adapters."""

from detlora.config import Determinism, LoRAReduction

__version__ = "0.1.0"
__all__ = ["Determinism", "LoRAReduction", "__version__"]
