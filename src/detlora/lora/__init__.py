"""LoRA adapters: requests, PEFT loading and checks, adapter slots with LRU eviction.

``LoRAConfig`` (max_loras, max_lora_rank) is defined beside the slots it sizes, in
``detlora.layers.lora_slots``, and re-exported here.
"""

from detlora.layers.lora_slots import LoRAConfig
from detlora.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
