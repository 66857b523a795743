"""Read-only views into an engine, for studies and debugging; nothing here runs in normal use.

* ``observe(engine, on_shrink=..., on_step=...)``: a context in which every LoRA shrink of
  an eager step reports its fp32 [S, M, R] output (per layer, by PEFT name), and every step
  reports its ``StepInputs`` and logits after the model ran (when the KV pages it wrote can
  be read with ``read_kv(engine, step.slot_mapping)``). Shrink outputs need an eager engine
  (``enforce_eager=True``): a captured CUDA graph replays without Python.
* ``read_kv(engine, slots, group_slots)``: copies of K and V at KV-cache slots (page *
  block_size + offset; a model with several KV groups, such as Gemma's window and full
  layers, has slots per group: ``StepInputs.group_slot_mapping``), [layers, n, kv_heads,
  head_dim] each (layers of other shapes zero-padded to the largest).
* ``continue_from_kv(engine, token_ids, k, v, ...)``: greedy decoding of one sequence whose
  first positions' K/V are given (say, another engine's), with this engine's model: the
  controlled experiment that tells whether a KV cache alone changes a token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from detlora.engine.llm_engine import LLMEngine
from detlora.engine.runner.step_inputs import StepInputs, mirror_groups
from detlora.lora.request import LoRARequest
from detlora.ops.lora_partials import ShrinkPartials, reduce_partials_ref

# (PEFT prefix of the layer, e.g. "model.layers.3.mlp.gate_up_proj", fp32 [S, M, R] copy)
ShrinkCallback = Callable[[str, torch.Tensor], None]
# (the step's inputs, its logits [len(step.logits_indices), V] in the model dtype or None)
StepCallback = Callable[[StepInputs, "torch.Tensor | None"], None]


@contextlib.contextmanager
def observe(
    engine: LLMEngine, *, on_shrink: ShrinkCallback | None = None,
    on_step: StepCallback | None = None,
) -> Iterator[None]:
    """Report shrink outputs and steps while the context is open (see the module docstring)."""
    _one_process(engine)
    model = engine.model
    linears = model.lora_linears()
    if on_shrink is not None:
        if engine.runner.uses_cuda_graphs:
            raise ValueError("observing LoRA shrinks needs an eager engine (enforce_eager=True):"
                             " a CUDA graph replays its steps without running Python")
        if not linears:
            raise ValueError("the engine has no LoRA layers to observe (enable_lora=False)")
    names = {id(lin): _layer_name(peft) for lin, peft in linears}
    runner = engine.runner
    real_execute = runner.execute

    def shrink_observer(layer: Any, x: torch.Tensor, h: Any, groups: Any) -> None:
        del x
        out = (reduce_partials_ref(h, groups.token_adapter) if isinstance(h, ShrinkPartials)
               else h.float().clone())
        on_shrink(names[id(layer)], out)

    def execute(step: StepInputs, decode_only: bool) -> Any:
        out = real_execute(step, decode_only)
        on_step(step, None if out is None else out.logits)
        return out

    try:
        if on_shrink is not None:
            for lin, _ in linears:
                lin.lora_observer = shrink_observer
        if on_step is not None:
            runner.execute = execute  # the instance attribute shadows the method
        yield
    finally:
        for lin, _ in linears:
            lin.__dict__.pop("lora_observer", None)
        runner.__dict__.pop("execute", None)


def _one_process(engine: LLMEngine) -> None:
    """These views read (and run) the model of this process: all of it at one rank only."""
    if engine.config.tensor_parallel_size > 1:
        raise ValueError("introspection reads the model of one process: build the engine "
                         "with tensor_parallel_size=1 (its bits are every size's)")


def _layer_name(peft_names: Sequence[str]) -> str:
    """A fused layer's name from its slices': "...mlp.gate_proj", "...mlp.up_proj" ->
    "...mlp.gate_up_proj"; "...q_proj", "...k_proj", "...v_proj" -> "...qkv_proj"."""
    if len(peft_names) == 1:
        return peft_names[0]
    prefix, _, _ = peft_names[0].rpartition(".")
    parts = [n.rpartition(".")[2].removesuffix("_proj") for n in peft_names]
    joined = "".join(parts) if all(len(p) == 1 for p in parts) else "_".join(parts)
    return f"{prefix}.{joined}_proj"


def read_kv(engine: LLMEngine, slots: Sequence[int],
            group_slots: Sequence[Sequence[int]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of K and V at ``slots`` (page * block_size + offset) and, for KV groups 1..,
    at ``group_slots``: [L, n, Hk, D] each, on the engine's device (a layer with fewer KV
    heads or a smaller head than the largest is zero-padded; a layer that reads another's
    K/V shows that layer's)."""
    _one_process(engine)
    kv = engine.runner.kv_cache
    groups = [list(slots), *map(list, group_slots)]
    layer_group = getattr(engine.model, "layer_group", [0] * len(kv.k))
    if max(layer_group) >= len(groups):
        raise ValueError(f"the model keeps its KV pages in {max(layer_group) + 1} groups: "
                         "give every group's slots")
    blocks = kv.group_blocks or (kv.num_blocks,)
    index = []
    for g, group in enumerate(groups):
        total = blocks[g] * kv.block_size
        bad = [s for s in group if not 0 <= s < total]
        if bad:
            raise ValueError(f"KV slots {bad[:5]} are outside the cache's [0, {total})")
        index.append(torch.tensor(group, dtype=torch.int64, device=kv.k[0].device))
    return (_stack_layers([c.flatten(0, 1).index_select(0, index[g])
                           for c, g in zip(kv.k, layer_group, strict=True)]),
            _stack_layers([c.flatten(0, 1).index_select(0, index[g])
                           for c, g in zip(kv.v, layer_group, strict=True)]))


def _stack_layers(rows: list[torch.Tensor]) -> torch.Tensor:
    """[n, Hk_l, D_l] per layer -> [L, n, max Hk, max D], zero-padded where smaller."""
    hk = max(r.shape[1] for r in rows)
    d = max(r.shape[2] for r in rows)
    if all(r.shape[1:] == (hk, d) for r in rows):
        return torch.stack(rows)
    out = rows[0].new_zeros(len(rows), rows[0].shape[0], hk, d)
    for i, r in enumerate(rows):
        out[i, :, : r.shape[1], : r.shape[2]] = r
    return out


@dataclass(frozen=True)
class ContinuedToken:
    token_id: int
    logits: torch.Tensor  # fp32 [V] on the CPU: the row the token was chosen from


@torch.inference_mode()
def continue_from_kv(
    engine: LLMEngine,
    token_ids: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    lora: LoRARequest | None = None,
    max_tokens: int = 1,
    stop_token_ids: Sequence[int] = (),
) -> list[ContinuedToken]:
    """Greedy tokens after ``token_ids`` when positions ``[0, n)`` hold the given K/V
    ([L, n, Hk, D], n = len(token_ids) - 1) and the last token is computed by this engine.

    The engine must be idle: the K/V go into its pages 0.., and the prefix cache is reset
    before and after so that no cached prefix points at them. Ties go to the lowest token
    id, as in the engine's greedy sampling."""
    _one_process(engine)
    if engine.has_unfinished():
        raise ValueError("continue_from_kv needs an idle engine (it writes the KV pages)")
    if engine.spec.hybrid is not None:
        raise ValueError(f"continue_from_kv continues from a KV cache alone; "
                         f"{engine.spec.architecture}'s Mamba-2 layers keep states beside it")
    spec, kv = engine.spec, engine.runner.kv_cache
    n = len(token_ids) - 1
    expected = (spec.num_layers, n, max(c.shape[2] for c in kv.k),
                max(c.shape[3] for c in kv.k))
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} (layers, len(token_ids) - 1, "
                             f"kv heads, head dim), got {tuple(t.shape)}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    length = n + max_tokens
    if length > engine.max_model_len:
        raise ValueError(f"{length} positions exceed max_model_len={engine.max_model_len}")
    if engine.model.position_offset(length):
        raise ValueError(f"{length} positions reach past this model's original LongRoPE "
                         "context, where its rotary rows depend on the sequence's length: "
                         "continue_from_kv does not support that")
    bs = kv.block_size
    pages = list(range(-(-length // bs)))
    room = min(kv.group_blocks or (kv.num_blocks,))
    if len(pages) > room:
        raise ValueError(f"{length} positions need {len(pages)} KV pages, the cache has "
                         f"{room}")
    engine.reset_prefix_cache()
    slot = -1
    if lora is not None:
        if engine.lora_manager is None:
            raise ValueError("a lora was given but the engine was built with enable_lora=False")
        slot = engine.lora_manager.activate([lora])[0]
    index = torch.arange(n, dtype=torch.int64, device=kv.k[0].device)
    for layer, (kc, vc) in enumerate(kv):  # each layer's own heads and head size
        hk, d = kc.shape[2], kc.shape[3]
        kc.flatten(0, 1).index_copy_(0, index, k[layer, :, :hk, :d].to(kc.device, kc.dtype))
        vc.flatten(0, 1).index_copy_(0, index, v[layer, :, :hk, :d].to(vc.device, vc.dtype))
    out: list[ContinuedToken] = []
    token, stops = int(token_ids[-1]), set(stop_token_ids)
    try:
        for p in range(n, length):
            step = mirror_groups(StepInputs(
                input_ids=[token], positions=[p], slot_mapping=[pages[p // bs] * bs + p % bs],
                token_adapter=[slot], block_tables=[pages], seq_lens=[p + 1],
                query_start_loc=[0, 1], logits_indices=[0]), engine.runner.kv_groups)
            row = engine.model(engine.runner.forward_batch(step))[0].cpu()
            token = int(torch.argmax(row))  # the first maximum: the lowest id on ties
            out.append(ContinuedToken(token, row))
            if token in stops:
                break
    finally:
        engine.reset_prefix_cache()
    return out
