"""Models: Hugging Face config.json + safetensors -> DecoderForCausalLM (Llama, Qwen3).

Submodules are imported directly (``detlora.models.loader``); this package imports nothing so
that layers can read ``detlora.layers.forward_batch`` without a cycle.
"""
