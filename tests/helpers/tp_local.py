"""Tensor-parallel ranks simulated on ONE device: threads of the test process whose
collectives go through shared memory, not a c10d backend.

``run_local_ranks(size, fn, device)`` calls ``fn(group)`` on ``size`` threads, one per rank,
and returns their results in rank order (re-raising the first failure). The ranks take turns:
one holds the baton from one collective to the next, so only one thread launches work at a
time, and on a GPU everything queues on the one stream in a fixed order (kernels' shared
workspaces and Triton's compile cache see one caller at a time). Collectives move bits as
the real ones do: ``all_gather`` stacks copies in rank order, ``broadcast`` copies, and
``all_reduce`` adds in rank order. This lets one GPU check what 2, 4 or 8 GPUs would compute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from detlora.distributed.group import TensorParallelGroup

T = TypeVar("T")
_WAIT_S = 600.0


class _Hub:
    """The baton and the collectives' mailboxes shared by the ranks."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.turn = 0
        self.done: set[int] = set()
        self.failed = False
        self.boxes: dict[int, list[torch.Tensor | None]] = {}

    def _wait(self, ready: Callable[[], bool]) -> None:
        if not self.cond.wait_for(lambda: self.failed or ready(), timeout=_WAIT_S):
            raise TimeoutError("a simulated rank did not reach the collective")
        if self.failed:
            raise RuntimeError("another simulated rank failed")

    def take_turn(self, rank: int, gen: int | None = None) -> None:
        """Wait for the baton (and, in a collective, for every rank's deposit)."""
        with self.cond:
            self._wait(lambda: self.turn == rank and (
                gen is None or all(t is not None for t in self.boxes[gen])))

    def pass_turn(self, rank: int, *, finished: bool = False) -> None:
        with self.cond:
            if finished:
                self.done.add(rank)
            nxt = (rank + 1) % self.size
            while nxt in self.done and len(self.done) < self.size:
                nxt = (nxt + 1) % self.size
            self.turn = nxt
            self.cond.notify_all()

    def deposit(self, gen: int, rank: int, tensor: torch.Tensor) -> None:
        with self.cond:
            self.boxes.setdefault(gen, [None] * self.size)[rank] = tensor

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()


class LocalGroup(TensorParallelGroup):
    """One rank of a group whose ranks are threads on one device (see the module)."""

    def __init__(self, hub: _Hub, rank: int, device: torch.device | str) -> None:
        super().__init__(rank, hub.size, torch.device(device), backend=hub)
        self.hub = hub
        self._gen = 0

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        gen, self._gen = self._gen, self._gen + 1
        self.hub.deposit(gen, self.rank, tensor.detach().clone())
        self.hub.pass_turn(self.rank)
        self.hub.take_turn(self.rank, gen)
        return self.hub.boxes[gen]  # type: ignore[return-value]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(tensor))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(tensor)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return tensor.copy_(total)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor.copy_(self._exchange(tensor)[src])


def run_local_ranks(size: int, fn: Callable[[TensorParallelGroup], T],
                    device: torch.device | str = "cpu") -> list[T]:
    if size == 1:
        with torch.inference_mode():
            return [fn(TensorParallelGroup.single(device))]
    hub = _Hub(size)
    results: list = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            hub.take_turn(rank)
            with torch.inference_mode():
                results[rank] = fn(LocalGroup(hub, rank, device))
        except BaseException as e:
            errors.append(e)
            hub.fail()
        finally:
            hub.pass_turn(rank, finished=True)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=_WAIT_S + 60)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a simulated rank did not finish")
    return results


def model_logits(base, adapter=None, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 kernels: bool | None = None, lengths=(5, 9, 3, 12)):
    """fn(group) -> (prefill logits, decode logits) of one rank's shard of the checkpoint at
    ``base`` at batch_invariant: a mixed prefill over a paged cache (every other sequence on
    the adapter at ``adapter``, in_gemm), then a decode step; the ValueError of a refused
    build is returned instead."""
    from detlora.layers.backend import make_backend
    from detlora.layers.lora_slots import LoRAConfig
    from detlora.lora.manager import LoRAManager
    from detlora.lora.request import LoRARequest
    from detlora.models.loader import load_model
    from tests.helpers.tiny_hf import PagedKV

    lora = LoRARequest("a", 1, str(adapter)) if adapter is not None else None

    def rank(group: TensorParallelGroup):
        backend = make_backend(device, "batch_invariant", dtype=dtype, max_lora_rank=16,
                               kernels=kernels)
        try:
            model = load_model(base, dtype=dtype, device=device, backend=backend, tp=group,
                               lora_config=LoRAConfig(max_loras=1, max_lora_rank=16)
                               if lora else None)
        except ValueError as e:
            return e
        model.allocate_kv_cache(num_blocks=64, block_size=16)
        slot_of = None
        if lora is not None:
            slots = LoRAManager(model).activate([lora if k % 2 else None
                                                 for k in range(len(lengths))])
            slot_of = dict(enumerate(slots))
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, model.spec.vocab_size, (n,), generator=g).tolist()
                   for n in lengths]
        kv = PagedKV(64, 16, seed=5, device=device)
        prefill = model(kv.step(dict(enumerate(prompts)), slot_of))
        decode = model(kv.step({s: [s + 1] for s in range(len(lengths))}, slot_of))
        return prefill, decode

    return rank
