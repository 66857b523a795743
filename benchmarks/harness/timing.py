"""Kernel timing by CUDA-graph replay.

One graph holds ``n`` calls, each on its own input set, so that the sets together exceed the
L2 cache and no call finds its operands already cached; replays are timed with CUDA events,
warm-up excluded, and the median per-call time is reported.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

L2_BYTES = 60 * 1024 * 1024  # the H200's L2: 60 MB


def input_sets_for(bytes_per_call: int, max_sets: int = 256, min_sets: int = 8) -> int:
    """How many rotating input sets keep one call's operands out of L2."""
    need = -(-2 * L2_BYTES // max(1, bytes_per_call))
    return max(min_sets, min(max_sets, need))


def time_graph_us(
    calls: Sequence[Callable[[], object]], replays: int = 15, warmup: int = 3
) -> float:
    """Median microseconds per call over graph replays of ``calls`` run back to back."""
    for call in calls:  # compile and allocate outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    del graph
    return statistics.median(times)
