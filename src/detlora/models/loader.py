"""Load a Hugging Face model directory (config.json + *.safetensors) into a detlora model.

Every checkpoint tensor is matched by name to the fused layer slice it fills (q/k/v into
qkv_proj, gate/up into gate_up_proj) and checked for shape; every expected weight must be
present exactly once and nothing unexpected may remain, so a checkpoint that does not match
its config fails loudly instead of running with uninitialised memory. Every weight must be
finite in the dtype it is loaded in (``finite_weights``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from detlora.distributed.group import TensorParallelGroup
from detlora.layers.backend import OpBackend, make_backend
from detlora.layers.lora_slots import LoRAConfig
from detlora.models.causal_lm import DecoderForCausalLM
from detlora.models.finite_weights import check_finite
from detlora.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from detlora.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from detlora.models.llama import LlamaForCausalLM
from detlora.models.lora_targets import LoRATargets
from detlora.models.mistral import MistralForCausalLM
from detlora.models.nemotron_h import NemotronHForCausalLM
from detlora.models.phi3 import Phi3ForCausalLM
from detlora.models.qwen2 import Qwen2ForCausalLM
from detlora.models.qwen3 import Qwen3ForCausalLM
from detlora.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec
from detlora.models.weights_hash import combine_digests, tensor_digest

logger = logging.getLogger("detlora")

ARCHITECTURES: dict[str, type[DecoderForCausalLM] | type[NemotronHForCausalLM]] = {
    cls.architecture: cls for cls in (LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM,
                                      MistralForCausalLM, Phi3ForCausalLM, Gemma3ForCausalLM,
                                      Gemma3ForConditionalGeneration, Gemma4ForCausalLM,
                                      Gemma4ForConditionalGeneration, NemotronHForCausalLM)
}
assert set(ARCHITECTURES) == set(SUPPORTED_ARCHITECTURES)

INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints saved; recomputed here, never loaded.
_IGNORED = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    backend: OpBackend | None = None,
    lora_config: LoRAConfig | None = None,
    max_positions: int | None = None,
    tp: TensorParallelGroup | None = None,
) -> DecoderForCausalLM:
    """Build the model named by ``path/config.json`` and load its weights.

    ``dtype`` defaults to the checkpoint's; ``backend`` to ``make_backend(device)``;
    ``lora_config`` reserves adapter slots (None: no LoRA); ``max_positions`` bounds the
    rotary table (default: max_position_embeddings); ``tp`` makes it this rank's shard (every
    rank reads whole tensors and keeps its part; the weights hash is the whole model's).
    """
    path = Path(path)
    spec = ModelSpec.from_dir(path)
    dtype = dtype or spec.dtype
    device = torch.device(device)
    backend = backend or make_backend(device, dtype=dtype)
    if backend.device.type != device.type:
        raise ValueError(f"backend is for {backend.device.type}, the model for {device.type}")
    model = ARCHITECTURES[spec.architecture](
        spec, backend=backend, dtype=dtype, device=device, lora=lora_config,
        max_positions=max_positions, tp=tp,
    )
    expected = model.hf_weights()
    digests: dict[str, str] = {}
    tied_head: torch.Tensor | None = None
    embedding: torch.Tensor | None = None
    unexpected: list[str] = []
    skipped: Counter[str] = Counter()  # why -> weights left out (the model says why)
    # A family's checkpoint spelling -> hf_weights' (NemotronH: backbone.* -> model.*).
    rename = getattr(model, "checkpoint_name", None)
    for file in checkpoint_files(path):
        with _opened(file) as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = rename(stored) if rename is not None else stored
                if _IGNORED.match(name):
                    continue
                why = model.skipped_weight(name)
                if why is not None:
                    skipped[why] += 1
                    continue
                if name == "lm_head.weight" and spec.tie_word_embeddings:
                    tied_head = f.get_tensor(stored).to(dtype)
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                if name in digests:
                    raise ValueError(f"weight {name!r} appears twice in the checkpoint "
                                     f"(again in {file.name})")
                shape, load = expected[name]
                t = f.get_tensor(stored)
                if tuple(t.shape) != shape:
                    raise ValueError(f"weight {name!r} in {file.name} has shape "
                                     f"{tuple(t.shape)}, expected {shape} from config.json")
                loaded = t.to(dtype)
                digests[name] = tensor_digest(loaded)
                if name == model.embedding_weight_name:
                    embedding = loaded
                on_device = loaded.to(device)
                _check_weight(on_device, t, f"{path}: weight {name!r} in {file.name}")
                load(on_device)
    for why, count in sorted(skipped.items()):
        logger.info("%s: left out %d checkpoint weight(s): %s", path, count, why)
    if unexpected:
        raise ValueError(f"{path}: {len(unexpected)} unexpected weight(s) in the checkpoint, "
                         f"e.g. {sorted(unexpected)[:5]} (does config.json match the weights?)")
    missing = sorted(set(expected) - set(digests))
    if missing:
        raise ValueError(f"{path}: {len(missing)} weight(s) missing from the checkpoint, "
                         f"e.g. {missing[:5]}")
    if tied_head is not None and embedding is not None and not torch.equal(tied_head,
                                                                           embedding):
        raise ValueError(f"{path}: tie_word_embeddings is true but lm_head.weight differs "
                         "from model.embed_tokens.weight")
    meta = {"spec": spec.canonical(), "dtype": str(dtype).replace("torch.", "")}
    model.set_weights_hash(combine_digests(digests, meta))
    return model.eval()


def _check_weight(loaded: torch.Tensor, stored: torch.Tensor, what: str) -> None:
    """``loaded`` (``stored`` in the model's dtype, on its device: checked where that is
    fastest) must be finite; a stored value the dtype cannot hold is named as such."""
    if not loaded.is_floating_point() or bool(torch.isfinite(loaded).all()):
        return
    if loaded.dtype != stored.dtype and bool(torch.isfinite(stored).all()):
        raise ValueError(f"{what} overflows {str(loaded.dtype).replace('torch.', '')}: "
                         f"its largest magnitude {stored.abs().max().item():g} does not fit "
                         "(load the checkpoint in its own dtype)")
    check_finite(loaded, what)


@contextlib.contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """``safe_open`` whose errors (a truncated or foreign file) name the file."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from None


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: those its index names, or every one."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e!r}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file} is named by {INDEX_FILE} but does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise ValueError(f"{path} holds only PyTorch pickle weights (*.bin / *.pt); detlora "
                         "loads safetensors only (convert with save_pretrained(..., "
                         "safe_serialization=True))")
    raise FileNotFoundError(f"{path} holds no *.safetensors weight file")


def lora_target_shapes_of(spec: ModelSpec) -> LoRATargets:
    """The LoRA targets of the model ``spec`` describes, without its weights: the model is
    built on the meta device (nothing allocated), as the loader builds it."""
    model = ARCHITECTURES[spec.architecture](spec, backend=make_backend("cpu"),
                                             dtype=torch.bfloat16, device="meta",
                                             max_positions=2)
    shapes = model.lora_target_shapes()
    return shapes if isinstance(shapes, LoRATargets) else LoRATargets(shapes)
