"""Qwen2 / Qwen2.5: Llama's block with biases on q, k and v (none on o_proj), added in the
GEMM's epilogue before its one rounding, so a row's bits never depend on the batch; tied
embeddings where tie_word_embeddings says so (the small sizes). use_sliding_window puts
sliding_window on the layers transformers windows (layer_types, else max_window_layers and
up), the others full attention (models/windows.py)."""

from __future__ import annotations

from detlora.models.causal_lm import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    architecture = "Qwen2ForCausalLM"
