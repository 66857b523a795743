"""Gemma 4 (dense): ``Gemma4ForCausalLM`` and the text tower of
``Gemma4ForConditionalGeneration`` checkpoints (weights under ``model.language_model.``; the
vision and audio towers' are left out; the multimodal placeholder ids are embedded as the pad
token, as HF's text-only forward does). The mixture-of-experts variant is refused by name
(models/gemma_config.py).

On Gemma 3's block (models/gemma3.py) Gemma 4 changes parameters and adds three parts:

* RMSNorm scales by ``w`` (not 1 + w), V is RMS-normed without a weight, the softmax is not
  scaled (1.0); full layers have their own head size (512 on E4B) and a "proportional"
  rotary table that turns only the first quarter of the frequencies;
* per-layer embeddings (layers/per_layer_embedding.py) feed each layer a small input through
  a gated branch after its MLP (layers/sandwich_layer.py), and each layer ends by scaling the
  whole residual stream by its checkpoint ``layer_scalar``;
* the last ``num_kv_shared_layers`` layers read the K/V of the last earlier layer of their
  type (sliding or full) and compute only q: they have no k/v projections, no pages of their
  own (models/kv_cache.py) and no k/v LoRA targets (an adapter holding them is refused,
  naming the layer). Their checkpoint k/v weights, if any, are left out as HF leaves them.
"""

from __future__ import annotations

from detlora.layers.linear import LinearBase
from detlora.models.causal_lm import WeightSlot
from detlora.models.gemma3 import GemmaForCausalLM
from detlora.models.lora_targets import LoRATargets

_SHARED_WEIGHTS = ("k_proj", "v_proj", "k_norm", "v_norm")


class Gemma4ForCausalLM(GemmaForCausalLM):
    architecture = "Gemma4ForCausalLM"

    def _shared_layer(self, name: str) -> int | None:
        """The layer of ``name`` if it is a k/v weight of a layer that reads another's K/V."""
        rest = name[len(self.prefix) + len("layers."):] \
            if name.startswith(self.prefix + "layers.") else ""
        index, _, tail = rest.partition(".")
        if not index.isdigit() or int(index) >= self.spec.num_layers:
            return None
        parts = tail.split(".")
        if len(parts) >= 2 and parts[0] == "self_attn" and parts[1] in _SHARED_WEIGHTS \
                and not self.layers[int(index)].self_attn.has_kv:
            return int(index)
        return None

    def skipped_weight(self, name: str) -> str | None:
        if self._shared_layer(name) is not None:
            return "k/v weights of KV-shared layers (they read an earlier layer's K/V)"
        return super().skipped_weight(name)

    def hf_weights(self) -> dict[str, WeightSlot]:
        out = super().hf_weights()
        s, p = self.spec, self.prefix
        for i, layer in enumerate(self.layers):
            lp = f"{p}layers.{i}."
            if layer.layer_scalar is not None:
                out[lp + "layer_scalar"] = ((1,), layer.load_layer_scalar)
            branch = layer.per_layer
            if branch is not None:
                size = branch.per_layer_input_gate.output_sizes[0]
                out[lp + "per_layer_input_gate.weight"] = (
                    (size, s.hidden_size), branch.per_layer_input_gate.load_weight)
                out[lp + "per_layer_projection.weight"] = (
                    (s.hidden_size, size), branch.per_layer_projection.load_weight)
                out[lp + "post_per_layer_input_norm.weight"] = (
                    (s.hidden_size,), branch.post_per_layer_input_norm.load_weight)
        ple = self.per_layer_embedding
        if ple is not None:
            width = ple.num_layers * ple.size
            out[p + "embed_tokens_per_layer.weight"] = (
                (ple.embed_tokens_per_layer.vocab_size, width),
                ple.embed_tokens_per_layer.load_weight)
            out[p + "per_layer_model_projection.weight"] = (
                (width, s.hidden_size), ple.per_layer_model_projection.load_weight)
            out[p + "per_layer_projection_norm.weight"] = (
                (ple.size,), ple.per_layer_projection_norm.load_weight)
        return out

    def _layer_linears(self, i: int) -> list[tuple[LinearBase, tuple[str, ...]]]:
        out = super()._layer_linears(i)
        branch = self.layers[i].per_layer
        if branch is not None:
            lp = f"{self.prefix}layers.{i}."
            out += [(branch.per_layer_input_gate, (lp + "per_layer_input_gate",)),
                    (branch.per_layer_projection, (lp + "per_layer_projection",))]
        return out

    def _model_linears(self) -> list[tuple[LinearBase, tuple[str, ...]]]:
        ple = self.per_layer_embedding
        if ple is None:
            return []
        return [(ple.per_layer_model_projection, (self.prefix + "per_layer_model_projection",))]

    def lora_linears(self) -> list[tuple[LinearBase, tuple[str, ...]]]:
        if self.lora_config is None:
            return []
        return self._model_linears() + super().lora_linears()

    def lora_target_shapes(self) -> LoRATargets:
        out = super().lora_target_shapes()
        for linear, (name,) in self._model_linears():
            out[name] = (linear.input_size, linear.output_sizes[0])
        for i in range(self.spec.num_layers):
            source = self.spec.attention(i).kv_source
            if source is not None:
                for proj in ("k_proj", "v_proj"):
                    out.refused[f"{self.prefix}layers.{i}.self_attn.{proj}"] = (
                        f"layer {i} is a KV-shared layer: it reads the keys and values of "
                        f"layer {source} and has no {proj} (a LoRA delta on layer {source}'s "
                        f"{proj} reaches it)")
        return out


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The text tower of a Gemma 4 multimodal checkpoint (text in, text out)."""

    architecture = "Gemma4ForConditionalGeneration"
