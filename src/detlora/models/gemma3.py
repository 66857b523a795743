"""Gemma 3: ``Gemma3ForCausalLM`` and the text tower of ``Gemma3ForConditionalGeneration``
checkpoints (weights under ``model.language_model.``; the vision tower's are left out).

The block (layers/sandwich_layer.py) puts attention and the MLP each between a pre-norm and a
post-norm; every RMSNorm scales by ``1 + w``; the MLP is GeGLU; the embedding is scaled by
sqrt(hidden_size) rounded to the model dtype first (sqrt(3072) = 55.4256 is 55.5 in bf16),
the tied LM head reads the unscaled table; q and k are RMS-normed per head before rotary and
the softmax scale is ``query_pre_attn_scalar ** -0.5``; layers are local (a sliding window,
rotary base 1e4) or global (full attention, base 1e6, optionally linearly scaled), five to
one by default; an optional final logit soft-cap. What differs between layers is a parameter
of each layer (``ModelSpec.layer_attention``, models/layer_spec.py), read from config.json
by models/gemma_config.py. Gemma 4 (models/gemma4.py) adds to ``GemmaForCausalLM``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from detlora.layers.linear import LinearBase
from detlora.layers.mlp import GatedMLP
from detlora.layers.norm import RMSNorm
from detlora.layers.per_layer_embedding import PerLayerEmbedding
from detlora.layers.sandwich_layer import PerLayerInputBranch, SandwichDecoderLayer
from detlora.models.causal_lm import (
    GATE_UP_MODULES,
    QKV_MODULES,
    DecoderForCausalLM,
    WeightSlot,
    _add_linear,
)
from detlora.models.lora_targets import LoRATargets
from detlora.models.spec import ModelSpec


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma 3 and 4: the parts both share; ``spec.gemma`` says what a checkpoint adds."""

    architecture: ClassVar[str]

    def __init__(self, spec: ModelSpec, **kwargs) -> None:
        if spec.gemma is None:
            raise ValueError(f"{type(self).__name__} needs a Gemma spec (models/gemma_config.py)")
        tp = kwargs.get("tp")
        if tp is not None and not tp.is_single:
            raise ValueError(f"{spec.architecture}: tensor parallelism is not supported for "
                             "Gemma models yet (use tensor_parallel_size=1)")
        super().__init__(spec, **kwargs)
        g = spec.gemma
        kw = self._kw()
        self.prefix = g.weight_prefix
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, unit_offset=g.norm_unit_offset,
                            **kw)
        # sqrt(hidden) rounded to the model dtype, as HF's buffer is before its multiply.
        self.register_buffer("embed_scale", torch.tensor(
            spec.hidden_size**0.5, device=self.device).to(self.dtype), persistent=False)
        ids = torch.tensor(g.placeholder_token_ids, dtype=torch.int64, device=self.device)
        self.register_buffer("placeholder_ids", ids if ids.numel() else None, persistent=False)
        self.per_layer_embedding: PerLayerEmbedding | None = None
        if g.per_layer_input_size:
            self.per_layer_embedding = PerLayerEmbedding(
                g.per_layer_vocab_size, spec.num_layers, g.per_layer_input_size,
                spec.hidden_size, spec.rms_norm_eps, lora=self.lora_config,
                unit_offset=g.norm_unit_offset, **kw)
        self.embedding_weight_name = self.prefix + "embed_tokens.weight"

    def build_layers(self) -> list[nn.Module]:
        spec = self.spec
        g = spec.gemma
        assert g is not None
        kw, eps = self._kw(), spec.rms_norm_eps
        layers: list[nn.Module] = []
        for i in range(spec.num_layers):
            attn = self.build_attention(i, qk_norm_eps=eps,
                                        qk_norm_unit_offset=g.norm_unit_offset,
                                        v_norm_eps=eps if g.v_norm else None)
            mlp = GatedMLP(spec.hidden_size, g.intermediate_sizes[i], activation="gelu_tanh",
                           lora=self.lora_config, tp=self.tp, **kw)
            norms = tuple(RMSNorm(spec.hidden_size, eps, unit_offset=g.norm_unit_offset, **kw)
                          for _ in range(4))
            branch = None
            if g.per_layer_input_size:
                branch = PerLayerInputBranch(spec.hidden_size, g.per_layer_input_size, eps,
                                             lora=self.lora_config,
                                             unit_offset=g.norm_unit_offset, **kw)
            layers.append(SandwichDecoderLayer(attn, mlp, norms, per_layer=branch,
                                               layer_scalar=g.layer_scalars, dtype=self.dtype,
                                               device=self.device))
        return layers

    # ---- compute ----

    def hidden_states(self, batch) -> torch.Tensor:
        groups = batch.lora.groups if batch.lora is not None else None
        ids = batch.input_ids
        if self.placeholder_ids is not None:  # multimodal placeholders: the pad token, as HF
            hit = (ids[:, None] == self.placeholder_ids[None, :]).any(dim=1)
            ids = torch.where(hit, self.spec.gemma.pad_token_id, ids)
        x = self.embed_tokens(ids) * self.embed_scale
        ple = None
        if self.per_layer_embedding is not None:
            ple = self.per_layer_embedding(ids, x, groups)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch.positions, batch.attn, groups,
                                None if ple is None else ple[:, i])
        if residual is None:  # the last layer closed the stream itself (Gemma 4)
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, upcast=False)
        cap = self.spec.gemma.final_logit_softcapping
        if cap is not None:
            assert self.backend.softcap is not None
            logits = self.backend.softcap(logits, cap)
        return logits.float() if upcast else logits

    # ---- checkpoint and adapter mapping ----

    def skipped_weight(self, name: str) -> str | None:
        if not name.startswith(self.prefix) and name != "lm_head.weight":
            return "not the text tower (vision/audio towers and their projections)"
        return None

    def hf_weights(self) -> dict[str, WeightSlot]:
        s, p = self.spec, self.prefix
        h = s.hidden_size
        out: dict[str, WeightSlot] = {
            p + "embed_tokens.weight": ((s.vocab_size, h), self.embed_tokens.load_weight),
            p + "norm.weight": ((h,), self.norm.load_weight),
        }
        if self.lm_head is not None:
            out["lm_head.weight"] = ((s.vocab_size, h), self.lm_head.load_weight)
        for i, layer in enumerate(self.layers):
            lp = f"{p}layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for name in ("input_layernorm", "post_attention_layernorm",
                         "pre_feedforward_layernorm", "post_feedforward_layernorm"):
                out[f"{lp}{name}.weight"] = ((h,), getattr(layer, name).load_weight)
            qkv = QKV_MODULES if attn.has_kv else QKV_MODULES[:1]
            _add_linear(out, lp + "self_attn.", qkv, attn.qkv_proj)
            _add_linear(out, lp + "self_attn.", ("o_proj",), attn.o_proj)
            _add_linear(out, lp + "mlp.", GATE_UP_MODULES, mlp.gate_up_proj)
            _add_linear(out, lp + "mlp.", ("down_proj",), mlp.down_proj)
            for norm_name in ("q_norm", "k_norm"):
                norm = getattr(attn, norm_name)
                if norm is not None:
                    out[f"{lp}self_attn.{norm_name}.weight"] = ((attn.head_dim,),
                                                                norm.load_weight)
        return out

    def _layer_linears(self, i: int) -> list[tuple[LinearBase, tuple[str, ...]]]:
        layer = self.layers[i]
        a, m = f"{self.prefix}layers.{i}.self_attn.", f"{self.prefix}layers.{i}.mlp."
        qkv = QKV_MODULES if layer.self_attn.has_kv else QKV_MODULES[:1]
        return [(layer.self_attn.qkv_proj, tuple(a + n for n in qkv)),
                (layer.self_attn.o_proj, (a + "o_proj",)),
                (layer.mlp.gate_up_proj, tuple(m + n for n in GATE_UP_MODULES)),
                (layer.mlp.down_proj, (m + "down_proj",))]

    def lora_linears(self) -> list[tuple[LinearBase, tuple[str, ...]]]:
        if self.lora_config is None:
            return []
        return [pair for i in range(self.spec.num_layers) for pair in self._layer_linears(i)]

    def lora_target_shapes(self) -> LoRATargets:
        out = LoRATargets()
        for i in range(self.spec.num_layers):
            for linear, names in self._layer_linears(i):
                for s, name in enumerate(names):
                    out[name] = (linear.input_size, linear.output_sizes[s])
        return out


class Gemma3ForCausalLM(GemmaForCausalLM):
    architecture = "Gemma3ForCausalLM"


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """The text tower of a Gemma 3 multimodal checkpoint (text in, text out)."""

    architecture = "Gemma3ForConditionalGeneration"
