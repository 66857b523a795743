"""The LoRA targets a model offers an adapter: PEFT module name -> (in_features,
out_features), plus the names it refuses with a reason (a module the checkpoint's
architecture lacks on purpose, such as k_proj of a layer that reads another layer's K/V)."""

from __future__ import annotations


class LoRATargets(dict[str, tuple[int, int]]):
    """A dict of target shapes with ``refused``: module name -> why it cannot be a target."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refused: dict[str, str] = {}

