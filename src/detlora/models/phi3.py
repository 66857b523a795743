"""Phi-3 / Phi-3.5 (Phi3ForCausalLM): Llama's block whose checkpoint fuses q|k|v into
``qkv_proj`` and gate|up into ``gate_up_proj``. The fused weights are split at load into our
fused layers' slices (the same GEMMs), and adapters may target the fused modules (one A, one
B spanning the slices: B's rows split by slice, A shared) or the split names. LongRoPE ("su")
scaling picks the short or long factors per sequence (ops/longrope.py). sliding_window
(2047 in Phi-3-mini-4k) is a window on every layer (models/windows.py). Phi-3-mini's and
Phi-3.5-mini's head_dim 96 runs in 128 padded lanes on the GPU (ops/paged_attention.py)."""

from __future__ import annotations

from types import MappingProxyType

from detlora.models.causal_lm import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    architecture = "Phi3ForCausalLM"
    fused_modules = MappingProxyType({
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    })
