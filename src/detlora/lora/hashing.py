"""Content hash of an adapter: its A/B tensors as stored and the scale of every module, so
two adapters hash equal exactly when they change a model's outputs the same way."""

from __future__ import annotations

from collections.abc import Mapping

from detlora.lora.adapter import LoRAModuleWeights
from detlora.models.weights_hash import combine_digests, tensor_digest


def adapter_hash(modules: Mapping[str, LoRAModuleWeights]) -> str:
    digests: dict[str, str] = {}
    for name, m in modules.items():
        digests[f"{name}.lora_A"] = tensor_digest(m.a)
        digests[f"{name}.lora_B"] = tensor_digest(m.b)
    # repr() keeps every bit of a float scale.
    scales = {name: repr(float(m.scale)) for name, m in sorted(modules.items())}
    return combine_digests(digests, {"scales": scales})
