"""Llama 3.x (and Llama 2 / Mistral-style checkpoints named LlamaForCausalLM): GQA, llama3
rope scaling, optionally tied embeddings (Llama 3.2 1B/3B), optional attention/MLP biases."""

from __future__ import annotations

from detlora.models.causal_lm import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    architecture = "LlamaForCausalLM"
