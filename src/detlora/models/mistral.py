"""Mistral: Llama's layers under Mistral's config keys (head_dim may differ from
hidden / heads, as in Mistral-Nemo). sliding_window w puts a w-key window on every layer
(models/windows.py; dropped while max_model_len <= w, where it is full attention bit for
bit); null is full attention. transformers reads a config.json without the key as a
4096-key window, and so does the spec."""

from __future__ import annotations

from detlora.models.causal_lm import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    architecture = "MistralForCausalLM"
