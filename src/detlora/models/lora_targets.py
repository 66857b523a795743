"""The LoRA targets a model offers an adapter: PEFT module name -> (in_features,
out_features), plus the names it refuses with a reason (a module the checkpoint's
architecture lacks on purpose, such as k_proj of a layer that reads another layer's K/V)."""

from __future__ import annotations


class LoRATargets(dict[str, tuple[int, int]]):
    """A dict of target shapes with ``refused``: module name -> why it cannot be a target."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refused: dict[str, str] = {}


def lora_target_shapes_of(spec) -> LoRATargets:
    """The LoRA targets of the model ``spec`` (a ModelSpec) describes, without its weights:
    the model is built on the meta device (nothing allocated), as the loader builds it."""
    import torch

    from detlora.layers.backend import make_backend
    from detlora.models.loader import ARCHITECTURES

    model = ARCHITECTURES[spec.architecture](spec, backend=make_backend("cpu"),
                                             dtype=torch.bfloat16, device="meta",
                                             max_positions=2)
    shapes = model.lora_target_shapes()
    if isinstance(shapes, LoRATargets):
        return shapes
    return LoRATargets(shapes)
