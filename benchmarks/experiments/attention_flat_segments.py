"""Decode latency of the batch-invariant paged attention: the segment loop nested (a block loop
per segment, segments strided over the split's CTAs) or flattened (one pipelined block loop over
a CTA's run of consecutive segments), the split-KV fold with 8 or 16 partial loads in flight,
and KV segments of 512 or 256 positions; beside the split-KV kernel that is not invariant.
Llama-3.2-3B heads (24 q / 8 kv of 128), CUDA-graph replays, median per call.

Bits: each variant's output on the first input set against the nested, 8-load, 512 variant
(``torch.equal``); segment 256 changes the numerics, so it is compared with itself nested.

    PYTHONPATH=src python benchmarks/experiments/attention_flat_segments.py OUT.json
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
# (flatten, fold groups, segment)
VARIANTS = ((False, 1, 512), (True, 1, 512), (True, 2, 512), (False, 2, 256), (True, 2, 256))
SHAPES = ((1, 1024), (1, 8192), (1, 32768), (16, 1024), (16, 8192), (16, 32768), (64, 256),
          (64, 1024), (64, 8192))


def set_variant(flatten: bool, groups: int, segment: int) -> None:
    pa.FLATTEN_SEGMENTS, pa.FOLD_GROUPS, pa.KV_SEGMENT = flatten, groups, segment


rows, bits = [], []
saved = (pa.FLATTEN_SEGMENTS, pa.FOLD_GROUPS, pa.KV_SEGMENT)
for b, ctx in SHAPES:
    calls = ba._decode_calls("split_kv", b, ctx, hq, hk, d, device)
    rows.append({"b": b, "ctx": ctx, "impl": "split_kv", "us": round(time_graph_us(calls, 10), 2)})
    print(rows[-1], flush=True)
    del calls
    ref = {}
    for flatten, groups, segment in VARIANTS:
        set_variant(flatten, groups, segment)
        try:
            calls = ba._decode_calls("detlora", b, ctx, hq, hk, d, device)
            out = calls[0]().clone()
            base = ref.setdefault(segment, out)
            bits.append({"b": b, "ctx": ctx, "flatten": flatten, "fold_groups": groups,
                         "segment": segment, "equal_to_nested_8": bool(torch.equal(out, base))})
            us = time_graph_us(calls, replays=10)
        finally:
            set_variant(*saved)
        del calls
        torch.cuda.empty_cache()
        rows.append({"b": b, "ctx": ctx, "impl": "detlora", "flatten": flatten,
                     "fold_groups": groups, "segment": segment, "us": round(us, 2)})
        print(rows[-1], bits[-1]["equal_to_nested_8"], flush=True)
meta = results_meta("python benchmarks/experiments/attention_flat_segments.py")
with open(sys.argv[1], "w") as f:
    json.dump({"meta": meta, "rows": rows, "bits": bits}, f, indent=1)
