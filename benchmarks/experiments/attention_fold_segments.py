"""Decode latency of the batch-invariant paged attention with its split-KV fold loading eight
partials at a time, for KV segments of 512 (the default) and 256 positions, beside the
split-KV kernel that is not invariant; Llama-3.2-3B heads (24 q / 8 kv of 128). CUDA-graph
replays, median per call. Segment length changes bits, so 256 is timed only.

    PYTHONPATH=src python benchmarks/experiments/attention_fold_segments.py OUT.json
"""

import json
import sys

import torch

from benchmarks.harness import results_meta
from benchmarks.harness.timing import time_graph_us
from detlora.ops import paged_attention as pa
from detlora.study import bench_attention as ba

hq, hk, d = ba.MODELS["llama3b"]
device = torch.device("cuda")
rows = []
for b, ctx in ((1, 1024), (1, 8192), (1, 32768), (16, 8192), (64, 256), (64, 1024)):
    for impl, segment in (("split_kv", None), ("detlora", 512), ("detlora", 256)):
        original = pa.KV_SEGMENT
        pa.KV_SEGMENT = segment or original
        try:
            calls = ba._decode_calls(impl, b, ctx, hq, hk, d, device)
            us = time_graph_us(calls, replays=10)
        finally:
            pa.KV_SEGMENT = original
        del calls
        torch.cuda.empty_cache()
        rows.append({"b": b, "ctx": ctx, "impl": impl, "segment": segment, "us": round(us, 2)})
        print(rows[-1], flush=True)
meta = results_meta("python benchmarks/experiments/attention_fold_segments.py")
with open(sys.argv[1], "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
