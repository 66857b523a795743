"""One-off GPU check, kept as the record of benchmarks/results/attention_prefetch.json
("split_rule" rows): decode latency of both attention kernels at the tile-sweep shapes.

    PYTHONPATH=src OUT=out python benchmarks/experiments/attention_decode_latency.py
"""

import json
import os

import torch

from benchmarks.harness.timing import time_graph_us
from detlora.study import bench_attention as ba

hq, hk, d = ba.MODELS["llama3b"]
rows = []
for b, ctx in ((1, 1024), (1, 8192), (16, 8192), (64, 256), (64, 1024)):
    for impl in ("detlora", "split_kv"):
        calls = ba._decode_calls(impl, b, ctx, hq, hk, d, torch.device("cuda"))
        us = time_graph_us(calls, replays=10)
        del calls
        torch.cuda.empty_cache()
        rows.append({"b": b, "ctx": ctx, "impl": impl, "us": round(us, 2)})
        print(rows[-1], flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "attention_decode_latency.json"), "w") as f:
    json.dump(rows, f)
