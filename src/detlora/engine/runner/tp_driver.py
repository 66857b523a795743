"""The engine's side of tensor parallelism: rank 0 drives the workers that hold the other
shards.

The engine process keeps the scheduler, the LoRA manager and the sampler, and runs rank 0's
shard itself; ``TensorParallelDriver.start`` starts ranks 1..N-1 (spawned worker processes,
or the other ranks of a ``torchrun`` launch) and joins their group. From then on every call
the engine makes on its runner goes to the workers first (``TensorParallelRunner``), so all
ranks run the same step, and the adapter slot writes of the LoRA manager are replayed on
their shards (``mirror_slot_writer``). The logits every rank gathers are sampled on rank 0
only.

One tensor-parallel size gives every other one's bits at batch_invariant (see
layers/parallel_linear.py), so nothing the engine reports depends on it there.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from detlora.distributed.group import TensorParallelGroup
from detlora.distributed.workers import (
    WorkerProcesses,
    torchrun_env,
    torchrun_rendezvous,
)
from detlora.engine.runner.model_runner import ModelRunner, StepLogits
from detlora.engine.runner.step_inputs import StepInputs
from detlora.engine.runner.tp_worker import ShardPayload, share_fed_tokens, worker_main

_GROUPS = itertools.count()


def next_group_name() -> str:
    """A name for the next engine's group (every torchrun rank counts its engines alike)."""
    return f"detlora_tp{next(_GROUPS)}"


def serve_as_torchrun_worker() -> None:
    """A torchrun rank > 0 inside its engine constructor: serve rank 0's engine (the one
    with the same place in the script's order of engines) until it shuts down, then end the
    process: only rank 0's script goes on."""
    rdv, payload = torchrun_rendezvous(next_group_name())
    worker_main(rdv, payload)
    raise SystemExit(0)


def launched_as_torchrun_worker(size: int) -> bool:
    """True in a torchrun rank > 0 of a launch whose world is this engine's group."""
    env = torchrun_env()
    if env is None:
        return False
    rank, world, _ = env
    if world != size:
        raise ValueError(f"tensor_parallel_size={size} under torchrun needs "
                         f"--nproc-per-node (times nodes) = {size}, got WORLD_SIZE={world}")
    return rank > 0


class TensorParallelDriver:
    def __init__(self, workers: WorkerProcesses, group: TensorParallelGroup) -> None:
        self.workers = workers
        self.group = group
        self._writes: list[tuple] = []  # adapter slot writes not yet sent
        workers.on_failure = group.abort
        # Workers end with the engine, or at the latest when the interpreter exits.
        self._finalizer = weakref.finalize(self, workers.shutdown)

    @classmethod
    def start(cls, size: int, payload: ShardPayload) -> TensorParallelDriver:
        """Start (or, under torchrun, meet) ranks 1..size-1 and join their group; they load
        their shards while the caller loads rank 0's."""
        if torchrun_env() is not None:
            workers = WorkerProcesses.from_torchrun(size, payload.group_name, payload)
        else:
            workers = WorkerProcesses.spawn(size, worker_main, payload)
        try:
            group = TensorParallelGroup.create(workers.store, 0, size, payload.device_of(0),
                                               name=payload.group_name)
        except BaseException as e:
            workers.shutdown()
            raise workers.explain(e) from e
        return cls(workers, group)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def worker_pids(self) -> dict[int, int]:
        """rank -> process id of the spawned workers (none under torchrun)."""
        return self.workers.pids

    # ---- setup ----

    def mirror_slot_writer(self, writer: Any) -> Any:
        """The LoRA manager's ``writer`` whose slot writes also reach the workers' shards
        (sent with the next command, so before any step that reads the slot)."""
        return _MirroredSlotWriter(writer, self._writes)

    def min_kv_blocks(self, local: Callable[[], int], kwargs: dict[str, Any]) -> int:
        """KV pages every rank has room for: each profiles a step on its shard, the least
        wins (the scheduler hands out one page count for all ranks)."""
        self.send(("kv_blocks", kwargs))
        mine = local()
        return min([mine, *self.workers.gather_replies()])

    def runner(self, local: Callable[[], ModelRunner], kwargs: dict[str, Any]
               ) -> TensorParallelRunner:
        """Rank 0's runner from ``local()`` and the workers' from ``kwargs``, built together
        (CUDA-graph capture meets in collectives)."""
        self.send(("runner", kwargs))
        runner = self._guard(local)
        states = self.workers.gather_replies()
        mine = runner.uses_cuda_graphs
        for rank, state in enumerate(states, start=1):
            if state["cuda_graphs"] != mine:
                raise RuntimeError(f"CUDA-graph capture {'failed' if mine else 'worked'} on "
                                   f"tensor-parallel rank {rank} but not on rank 0 "
                                   f"({state['graph_error'] or runner.graph_error})")
        return TensorParallelRunner(self, runner)

    # ---- commands ----

    def send(self, message: tuple) -> None:
        """``message`` to every worker, after the adapter writes made since the last one."""
        if self._writes:
            writes = list(self._writes)
            self._writes.clear()
            self.workers.send(("lora", writes))
        self.workers.send(message)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run rank 0's part of a command; an error there (a lost worker, most often) is
        final: the ranks are out of step, so every later call raises it again."""
        try:
            return fn()
        except BaseException as e:
            error = self.workers.explain(e)
            self.workers.fail(error)
            if error is e:
                raise
            raise error from e

    def shutdown(self) -> None:
        self._finalizer()


class TensorParallelRunner:
    """``ModelRunner``'s interface for the engine over every rank's runner."""

    def __init__(self, driver: TensorParallelDriver, local: ModelRunner) -> None:
        self.driver = driver
        self.local = local

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.local.uses_cuda_graphs

    @property
    def graph_error(self) -> str | None:
        return self.local.graph_error

    @property
    def kv_cache(self):
        return self.local.kv_cache

    @property
    def fed_tokens(self) -> torch.Tensor:
        return self.local.fed_tokens

    def feed(self, tokens: torch.Tensor) -> None:
        """Rank 0 keeps them; a step that reads them broadcasts them first."""
        self.local.feed(tokens)

    def close(self) -> None:
        """Free rank 0's graphs and KV cache now (the workers free theirs when the driver
        shuts them down)."""
        self.local.close()

    def execute(self, step: StepInputs, decode_only: bool) -> StepLogits | None:
        self.driver.send(("execute", step, decode_only))

        def run() -> StepLogits | None:
            share_fed_tokens(self.driver.group, self.local, step)
            return self.local.execute(step, decode_only)

        return self.driver._guard(run)

    def prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.driver.send(("prompt_logits", hidden.shape[0]))

        def run() -> torch.Tensor:
            rows = self.driver.group.broadcast(hidden.contiguous(), src=0)
            return self.local.prompt_logits(rows)

        return self.driver._guard(run)


class _MirroredSlotWriter:
    """The LoRA manager's slot writer, except that every write and clear is also queued for
    the workers, which read the adapter themselves and write their own parts of it."""

    def __init__(self, writer: Any, writes: list[tuple]) -> None:
        self._writer = writer
        self._writes = writes

    def write(self, slot: int, image: Any) -> Any:
        copied = self._writer.write(slot, image)
        self._writes.append(("write", slot, image.request, image.hash))
        return copied

    def clear(self, slot: int) -> None:
        self._writer.clear(slot)
        self._writes.append(("clear", slot))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


__all__ = ["TensorParallelDriver", "TensorParallelRunner", "launched_as_torchrun_worker",
           "next_group_name", "serve_as_torchrun_worker"]
