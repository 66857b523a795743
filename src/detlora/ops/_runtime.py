"""Where kernels run: CUDA, or Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Triton decides between compiling and interpreting when a kernel is *decorated*, so the
environment variable must be set before any ``detlora.ops`` kernel module is imported.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_available_for(tensor: torch.Tensor) -> bool:
    """Triton kernels can run on this tensor: it is on CUDA, or the interpreter is on."""
    return tensor.is_cuda or (interpreting() and tensor.device.type == "cpu")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_chunks(n: int, chunk_cap: int, max_chunks: int) -> tuple[int, int, int]:
    """(CHUNK, NUM_CHUNKS, num_warps) for splitting rows of ``n`` elements into chunks of at
    most ``chunk_cap`` (a power of 2): a function of n alone, so a row's reduction tree never
    depends on the batch. ValueError when more than ``max_chunks`` chunks are needed."""
    chunk = min(next_power_of_2(n), chunk_cap)
    num_chunks = cdiv(n, chunk)
    if num_chunks > max_chunks:
        raise ValueError(
            f"x rows of {n} elements need {num_chunks} chunks of {chunk}; "
            f"at most {max_chunks} are supported"
        )
    return chunk, num_chunks, min(8, max(1, chunk // 512))
