"""Mistral: Llama's layers under Mistral's config keys (head_dim may differ from
hidden / heads, as in Mistral-Nemo). sliding_window null is full attention; a window of w
keys is full attention bit for bit while max_model_len <= w, and refused above that until
the paged KV cache implements windows (models/windows.py). transformers reads a config.json
without the key as a 4096-key window, and so does the spec."""

from __future__ import annotations

from detlora.models.causal_lm import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    architecture = "MistralForCausalLM"
