"""How many CTAs should share a decode tile's KV segments, now that decode steps run on the
16-row tile (more CTAs fit an SM than with the 64-row one)? Decode latency of the
batch-invariant attention (max_query_len 1, Llama-3.2-3B heads) for a range of fixed
``kv_ctas`` against the default rule, CUDA-graph replays. ``kv_ctas`` never changes bits.

    PYTHONPATH=src python benchmarks/experiments/attention_decode_ctas.py OUT.json
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
rule = pa.default_kv_ctas
rows = []
meta = {**results_meta("python benchmarks/experiments/attention_decode_ctas.py"),
        "note": "decode tile (16 rows, 4 warps); kv_ctas fixed vs the default rule "
                "(default_kv_ctas, capped by the segment count)"}
for b in (1, 4, 8, 16, 32, 64):
    for ctx in (1024, 8192, 32768):
        segs = -(-ctx // pa.KV_SEGMENT)
        choices = [None] + [c for c in (1, 2, 3, 4, 6, 8, 12, 16, 24, 33)
                            if c <= segs and b * hk * c <= 1100]
        for ctas in choices:
            if ctas is not None:
                pa.default_kv_ctas = lambda tiles, floats, c=ctas: c
            try:
                calls = ba._decode_calls("detlora", b, ctx, hq, hk, d, device)
                us = time_graph_us(calls, replays=10)
            finally:
                pa.default_kv_ctas = rule
            del calls
            torch.cuda.empty_cache()
            default = min(rule(b * hk, 0), segs)
            rows.append({"b": b, "ctx": ctx, "kv_ctas": ctas or f"default ({default})",
                         "us": round(us, 2)})
            print(rows[-1], flush=True)
            with open(sys.argv[1], "w") as f:  # after every row: a cut-off run keeps its data
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
