"""The ranks one model is split over, and the collectives its layers use between them.

A ``TensorParallelGroup`` is what a layer sees of tensor parallelism: its rank, the group's
size and three collectives on the model's device. ``all_gather`` and ``broadcast`` move bits
without arithmetic, so their results do not depend on the transport's algorithm; only
``all_reduce`` adds, in an order the transport picks (NCCL pins it at run_to_run, see
``detlora.distributed.nccl_env``), and the exact reductions of batch_invariant never use it.

The group wraps a c10d backend object (ProcessGroupNCCL on CUDA, ProcessGroupGloo on the CPU)
built for this engine alone, not torch.distributed's global default group, so several engines
can live in one process and nothing global is initialised. Size 1 (``single``) needs no
backend and every collective is the identity.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch
import torch.distributed as dist

# How long a collective waits for the other ranks before failing. Ranks meet in collectives
# only within a step (the engine sends a step to every rank at once), so this bounds a hang,
# not the time between steps; a dead rank is noticed sooner (gloo: at once; NCCL: the
# engine's process monitor aborts the group).
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


class TensorParallelGroup:
    def __init__(self, rank: int, size: int, device: torch.device, backend: Any = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of size {size}")
        if size > 1 and backend is None:
            raise ValueError("a group of more than one rank needs a c10d backend")
        self.rank = rank
        self.size = size
        self.device = torch.device(device)
        self.backend = backend

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> TensorParallelGroup:
        """One rank: the model is not split."""
        return cls(0, 1, torch.device(device))

    @classmethod
    def create(
        cls, store: dist.Store, rank: int, size: int, device: torch.device | str, *,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT, name: str = "detlora_tp",
    ) -> TensorParallelGroup:
        """Join the group of ``size`` ranks that meet in ``store`` (every rank calls this):
        gloo on the CPU, NCCL on CUDA (the current device set to ``device`` first). Returns
        once every rank has joined (a first all-gather, which also creates the NCCL
        communicator outside any CUDA-graph capture)."""
        device = torch.device(device)
        prefixed = dist.PrefixStore(f"{name}/", store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = timeout
            backend: Any = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        elif device.type == "cpu":
            backend = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        else:
            raise ValueError(f"tensor parallelism runs on 'cpu' or 'cuda', not {device}")
        group = cls(rank, size, device, backend)
        joined = group.all_gather(torch.tensor([rank], device=device))
        if joined.flatten().tolist() != list(range(size)):
            raise RuntimeError(f"tensor-parallel group {name!r} joined out of order: "
                               f"{joined.flatten().tolist()}")
        return group

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` stacked in rank order: [size, *tensor.shape] (copies only)."""
        if self.size == 1:
            return tensor.unsqueeze(0)
        flat = tensor.contiguous().view(-1)
        out = torch.empty(self.size * flat.numel(), dtype=tensor.dtype, device=tensor.device)
        self.backend._allgather_base(out, flat).wait()
        return out.view(self.size, *tensor.shape)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (the transport's order: not for exact reductions)."""
        if self.size > 1:
            self.backend.allreduce([tensor], dist.AllreduceOptions()).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` on every rank, in place."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            self.backend.broadcast([tensor], opts).wait()
        return tensor

    def abort(self) -> None:
        """Make collectives blocked on a lost peer return (NCCL); best effort."""
        abort = getattr(self.backend, "abort", None)
        if abort is not None:
            with contextlib.suppress(Exception):  # already failing: nothing better to do
                abort()

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, size={self.size}, device={self.device})"
