"""Capturing one CUDA graph of the decode or step graphs: warm up, then record.

The warm-up runs the forward once on the capture stream, outside the graph: it compiles the
kernels and grows the workspaces the graph will then own. Both run under ``pdl_launches``
(ops/pdl.py), so the warm-up compiles the kernel variants the graph records: decode and
step kernels are a few microseconds each, and PDL hides the gaps between them.
"""

from __future__ import annotations

import gc
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from tqdm import tqdm

from detlora.layers.forward_batch import ForwardBatch

Forward = Callable[[ForwardBatch], tuple[torch.Tensor, ...]]


def capture_bucket(
    forward: Forward, batch: Callable[[], ForwardBatch], *, pool: object,
    stream: torch.cuda.Stream, device: torch.device,
) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    """The graph of ``forward(batch())`` in the memory pool ``pool``, and its outputs (static
    tensors a replay overwrites). ``batch`` builds views of the graph's input buffers, which
    the caller has filled with valid inputs."""
    from detlora.ops.pdl import pdl_launches  # imports Triton: CUDA only

    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with pdl_launches():
        with torch.cuda.stream(stream):
            forward(batch())  # warm-up: compiles kernels, grows workspaces
        current.wait_stream(stream)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = forward(batch())
    return graph, outputs


def capture_progress(total: int, *, enabled: bool) -> tqdm:
    """A bar over the ``total`` graphs being captured (each compiles its kernels first), on
    stderr: off unless ``enabled``, there is a graph to capture and stderr is a terminal.
    Host-side only: it changes nothing the graphs record."""
    return tqdm(total=total, desc="capturing CUDA graphs", unit="graph", leave=False,
                disable=not (enabled and total > 0 and sys.stderr.isatty()), file=sys.stderr,
                dynamic_ncols=True)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect dead reference cycles now, then keep Python's cyclic GC off until the block
    ends (restored on errors). torch's ``graph`` no longer collects before capturing (torch
    2.11), and anything dropped in a reference cycle lives until a collection: one that
    started mid-capture and destroyed CUDA graphs there (a dropped engine's, when its
    runner's graphs still held its bound forward) silently invalidated the capture (see
    docs/decisions.md, "Capture with the GC paused"). Engines hold no such cycle now; this
    stays as the guard for whatever else a user drops."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def describe_capture_failure(error: BaseException) -> str:
    """``error`` and the errors it was raised while handling, the first one first, with the
    detlora line that made the first one. A capture that an illegal call invalidated fails
    again when it ends (``operation failed due to a previous error during capture``): only the
    first error names the call."""
    chain = [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None \
            and cause not in chain:
        chain.append(cause)
    first = chain[-1]
    ours = [f for f in traceback.extract_tb(first.__traceback__)
            if "detlora" in f.filename.replace("\\", "/").split("/")]
    where = f" (at {ours[-1].filename}:{ours[-1].lineno} in {ours[-1].name})" if ours else ""
    return " -> ".join(f"{type(e).__name__}: {e}" for e in reversed(chain)) + where


__all__ = ["Forward", "capture_bucket", "capture_progress", "describe_capture_failure",
           "gc_paused"]
