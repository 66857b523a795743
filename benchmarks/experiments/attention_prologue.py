"""Batch-invariant paged attention, split-KV path: the first block's pages loaded with the
kernel's first index loads (one round trip before the first K/V load instead of three), and a
one-segment context written directly instead of through the scratch fold. New kernel against
the kernel of a9244d1 (a copy of that commit's ops/paged_attention.py, path in argv[2]).

    git show a9244d1:src/detlora/ops/paged_attention.py > old_paged_attention_a9244d1.py
    PYTHONPATH=src python benchmarks/experiments/attention_prologue.py OUT.json \
        old_paged_attention_a9244d1.py

Decode steps on Llama-3.2-3B heads (24 q / 8 kv of 128), CUDA-graph replay median per call;
bits: the first call's output of both kernels (``torch.equal``).
"""

import importlib.util
import json
import sys

import torch

from benchmarks.harness import results_meta
from benchmarks.harness.timing import time_graph_us
from detlora.ops import paged_attention as pa
from detlora.study import bench_attention as ba

spec = importlib.util.spec_from_file_location("old_paged_attention", sys.argv[2])
old = importlib.util.module_from_spec(spec)
sys.modules["old_paged_attention"] = old  # dataclasses look their module up there
spec.loader.exec_module(old)
hq, hk, d = ba.MODELS["llama3b"]
device = torch.device("cuda")
SHAPES = ((1, 100), (1, 256), (1, 1024), (1, 8192), (1, 32768), (16, 256), (16, 8192),
          (64, 256), (64, 1024))
rows = []
for b, ctx in SHAPES:
    calls = ba._decode_calls("split_kv", b, ctx, hq, hk, d, device)
    rows.append({"b": b, "ctx": ctx, "impl": "split_kv", "us": round(time_graph_us(calls, 10), 2)})
    print(rows[-1], flush=True)
    del calls
    outs = {}
    for name, module in (("a9244d1", old), ("new", pa)):
        ba.pa = module  # _decode_calls launches ba.pa.paged_attention
        try:
            calls = ba._decode_calls("detlora", b, ctx, hq, hk, d, device)
            outs[name] = calls[0]().clone()
            us = time_graph_us(calls, replays=10)
        finally:
            ba.pa = pa
        del calls
        torch.cuda.empty_cache()
        rows.append({"b": b, "ctx": ctx, "impl": name, "us": round(us, 2),
                     "equal_to_a9244d1": bool(torch.equal(outs[name], outs["a9244d1"]))})
        print(rows[-1], flush=True)
meta = results_meta("python benchmarks/experiments/attention_prologue.py OUT.json "
                    "old_paged_attention_a9244d1.py")
with open(sys.argv[1], "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
