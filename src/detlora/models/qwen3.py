"""Qwen3 (dense): Llama's block plus a per-head RMSNorm of q and k before rotary (q_norm,
k_norm, eps = rms_norm_eps); no q/k/v bias unless config.json asks for it; embeddings tied
when tie_word_embeddings says so (the small Qwen3 sizes)."""

from __future__ import annotations

from detlora.models.causal_lm import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    architecture = "Qwen3ForCausalLM"
