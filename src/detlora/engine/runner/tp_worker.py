"""A tensor-parallel worker: one rank's model shard and runner, driven by the engine's rank 0.

The driver (``tp_driver.TensorParallelDriver``) sends every call it makes on its own shard's
runner; the worker makes the same call on its shard, so the ranks meet in the same
collectives in the same order (eager steps, CUDA-graph replays, graph capture). It keeps no
scheduler and samples nothing: the logits every rank gathers are read on rank 0 only.

Commands (tuples, the first item the name):
    ("kv_blocks", kwargs)          profile a step, reply the KV pages this rank has room for
    ("runner", kwargs)             build the ModelRunner (and its CUDA graphs), reply its state
    ("execute", step, decode_only) one step (fed tokens broadcast from rank 0 first)
    ("prompt_logits", rows)        the LM head on [rows, H] hidden states broadcast by rank 0
    ("lora", writes)               the driver's adapter slot writes and clears, in order
    ("shutdown",)                  return
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import torch

from detlora.config import Determinism, LoRAReduction
from detlora.distributed.group import TensorParallelGroup
from detlora.distributed.workers import DriverLink, Rendezvous, run_worker, torchrun_env
from detlora.engine.runner import kv_sizing
from detlora.engine.runner.model_runner import ModelRunner
from detlora.engine.runner.step_inputs import StepInputs
from detlora.layers.backend import make_backend
from detlora.layers.lora_slots import LoRAConfig
from detlora.lora.adapter import LoRAAdapter
from detlora.lora.peft_loader import load_peft_adapter
from detlora.lora.request import LoRARequest


@dataclasses.dataclass(frozen=True)
class ShardPayload:
    """What every rank needs to build its shard the way the driver builds its own."""

    model: str
    dtype: torch.dtype
    device: str  # "cpu" or "cuda": rank r takes cuda:(device_index + r) (torchrun: LOCAL_RANK)
    device_index: int
    determinism: Determinism
    lora_reduction: LoRAReduction
    max_lora_rank: int
    lora: LoRAConfig | None
    max_positions: int
    num_threads: int  # the driver's torch threads: CPU kernels keep the same bits
    group_name: str

    def device_of(self, rank: int) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        env = torchrun_env()
        return torch.device("cuda", env[2] if env is not None else self.device_index + rank)


def fed_rows(step: StepInputs) -> int:
    """How many of the previous step's sampled tokens this step reads (input ids -1 - r)."""
    return max((-1 - t for t in step.input_ids if t < 0), default=-1) + 1


def share_fed_tokens(group: TensorParallelGroup, runner: ModelRunner, step: StepInputs) -> None:
    """Rank 0 sampled the tokens a step launched ahead reads: every rank gets them (on the
    device, queued behind the sampler, no host round trip)."""
    n = fed_rows(step)
    if n:
        group.broadcast(runner.fed_tokens[:n], src=0)


class _AdapterSlots:
    """A worker's side of the LoRA manager's slot writes: it reads the adapter itself (the
    driver's host cache holds rank 0's parts) and writes its own parts into the slot, with
    the values the driver's slot writer gives rank 0's. A few adapters stay in memory, so a
    slot swap back does not read the disk again."""

    KEEP = 8

    def __init__(self, model: torch.nn.Module, max_rank: int) -> None:
        self.linears = model.lora_linears()
        self.target_shapes = model.lora_target_shapes()
        self.fused = model.lora_fused_targets()
        self.max_rank = max_rank
        self._adapters: OrderedDict[tuple[int, str], LoRAAdapter] = OrderedDict()

    def apply(self, writes: list[tuple]) -> None:
        """("write", slot, LoRARequest, content hash) or ("clear", slot), in order."""
        for kind, slot, *rest in writes:
            if kind == "clear":
                for linear, _ in self.linears:
                    linear.clear_lora(slot)
                continue
            request, content_hash = rest
            adapter = self._adapter(request)
            if adapter.hash != content_hash:
                raise ValueError(f"adapter {request.name!r} (id {request.id}) at {request.path} "
                                 "changed on disk after rank 0 read it")
            for linear, names in self.linears:
                mods = [adapter.modules.get(n) for n in names]
                present = [m for m in mods if m is not None]
                linear.set_lora(slot, [None if m is None else m.a for m in mods],
                                [None if m is None else m.b for m in mods],
                                present[0].scale if present else 0.0)

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        key = (request.id, request.path)
        adapter = self._adapters.pop(key, None)
        if adapter is None:
            adapter = load_peft_adapter(request.path, self.target_shapes, self.max_rank,
                                        self.fused)
        self._adapters[key] = adapter
        while len(self._adapters) > self.KEEP:
            self._adapters.popitem(last=False)
        return adapter


class _Worker:
    def __init__(self, payload: ShardPayload, group: TensorParallelGroup) -> None:
        from detlora.models.loader import load_model

        self.payload = payload
        self.group = group
        self.device = group.device
        backend = make_backend(self.device, payload.determinism, payload.lora_reduction,
                               dtype=payload.dtype, max_lora_rank=payload.max_lora_rank)
        self.model = load_model(payload.model, dtype=payload.dtype, device=self.device,
                                backend=backend, lora_config=payload.lora,
                                max_positions=payload.max_positions, tp=group)
        self.slots = (_AdapterSlots(self.model, payload.max_lora_rank)
                      if payload.lora is not None else None)
        self.runner: ModelRunner | None = None

    def serve(self, link: DriverLink) -> None:
        while True:
            name, *args = link.recv()
            if name == "shutdown":
                return
            result = getattr(self, f"_{name}")(*args)
            if name in ("kv_blocks", "runner"):
                link.reply(result)

    def _kv_blocks(self, kwargs: dict[str, Any]) -> int:
        def factory(n: int) -> ModelRunner:
            return ModelRunner(self.model, device=self.device, num_blocks=n,
                               use_cuda_graphs=False, **kwargs["runner"])

        return kv_sizing.cuda_num_blocks(factory, self.model, device=self.device,
                                         **kwargs["sizing"])

    def _runner(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        self.runner = ModelRunner(self.model, device=self.device, **kwargs)
        return {"cuda_graphs": self.runner.uses_cuda_graphs,
                "graph_error": self.runner.graph_error}

    def _execute(self, step: StepInputs, decode_only: bool) -> None:
        assert self.runner is not None
        share_fed_tokens(self.group, self.runner, step)
        self.runner.execute(step, decode_only)

    def _prompt_logits(self, rows: int) -> None:
        assert self.runner is not None
        hidden = torch.empty(rows, self.model.spec.hidden_size, dtype=self.payload.dtype,
                             device=self.device)
        self.group.broadcast(hidden, src=0)
        self.runner.prompt_logits(hidden)

    def _lora(self, writes: list[tuple]) -> None:
        assert self.slots is not None
        self.slots.apply(writes)


def worker_main(rdv: Rendezvous, payload: ShardPayload) -> None:
    """A worker process (spawned by the driver, or a torchrun rank > 0)."""
    torch.set_num_threads(payload.num_threads)

    def serve(link: DriverLink) -> None:
        device = payload.device_of(rdv.rank)
        group = TensorParallelGroup.create(rdv.connect_store(), rdv.rank, rdv.size, device,
                                           name=payload.group_name)
        _Worker(payload, group).serve(link)

    run_worker(rdv, serve)
