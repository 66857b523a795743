"""One-off GPU experiment, kept as the record of benchmarks/results/attention_decode_tile.json:
can the batch-invariant attention run decode steps on a smaller tile than the prefill's
(64 rows, 4 warps) and keep its bits? Also times split-KV with 2 and 3 stages.

    PYTHONPATH=src OUT=out python benchmarks/experiments/attention_decode_tile.py

Decode rows of a 3000-token sequence (every 7th position) computed on each candidate tile
are compared with ``torch.equal`` against the same rows of one full prefill.
"""

import json
import os
import sys

import torch

from benchmarks.harness.timing import time_graph_us
from detlora.ops import paged_attention as pa
from detlora.ops import paged_attention_split_kv as skv
from detlora.study import bench_attention as ba

out_path = os.path.join(os.environ.get("OUT", "."), "attention_decode_tile.json")
dev = torch.device("cuda")
default = pa.tile_config
result = {"bits": [], "latency": [], "split_kv_stages": []}


def with_tile(bm, warps, stages):
    def cfg(head_dim, group):
        return pa.TileConfig(bm, warps, stages)
    return cfg


for model in ("llama3b", "qwen3_0_6b"):
    hq, hk, d = ba.MODELS[model]
    length = 3000
    pool = ba._Pool([length, 1700], hq, hk, d, seed=21, device=dev)
    full = pool.attend([(0, 0, length)])[0]
    full1 = pool.attend([(1, 0, 1700)])[0]
    steps = [*range(0, length, 7), length - 1]
    for bm, warps, stages in ((16, 1, 3), (16, 4, 3), (32, 2, 3), (16, 1, 2), (64, 4, 3)):
        pa.tile_config = with_tile(bm, warps, stages)
        try:
            dec = pool.attend([(0, p, p + 1) for p in steps], max_query_len=1)
            mism = sum(int(not torch.equal(r, full[p:p + 1]))
                       for p, r in zip(steps, dec, strict=True))
            # a batch of decode rows from two sequences, split and unsplit
            mixed = pool.attend([(1, 1699, 1700), (0, 2999, 3000)], max_query_len=1, kv_ctas=1)
            mism += int(not torch.equal(mixed[0], full1[1699:1700]))
            mism += int(not torch.equal(mixed[1], full[2999:3000]))
            err = None
        except Exception as exc:
            mism, err = None, repr(exc)[:300]
        finally:
            pa.tile_config = default
        row = {"model": model, "block_m": bm, "warps": warps, "stages": stages,
               "cases": len(steps) + 2, "mismatches": mism, "error": err}
        print(row, flush=True)
        result["bits"].append(row)

hq, hk, d = ba.MODELS["llama3b"]
for b, ctx in ((1, 1024), (1, 8192), (16, 8192), (64, 256), (64, 1024)):
    for bm, warps, stages in ((64, 4, 3), (16, 1, 3), (16, 1, 2), (16, 4, 3), (32, 2, 3)):
        pa.tile_config = with_tile(bm, warps, stages)
        try:
            calls = ba._decode_calls("detlora", b, ctx, hq, hk, d, dev)
            us = time_graph_us(calls, replays=10)
        except Exception as exc:
            us = None
            print("fail", b, ctx, bm, warps, repr(exc)[:200])
        finally:
            pa.tile_config = default
            calls = None
            torch.cuda.empty_cache()
        row = {"b": b, "ctx": ctx, "block_m": bm, "warps": warps, "stages": stages, "us": us}
        print(row, flush=True)
        result["latency"].append(row)
    orig = skv.split_kv_config
    for stages in (2, 3):
        skv.split_kv_config = lambda h, g, dec, s=stages: (
            (16, 4, s) if dec and g <= 16 else (pa.tile_config(h, g).block_m,
                                                pa.tile_config(h, g).num_warps, s))
        try:
            calls = ba._decode_calls("split_kv", b, ctx, hq, hk, d, dev)
            us = time_graph_us(calls, replays=10)
        finally:
            skv.split_kv_config = orig
            calls = None
            torch.cuda.empty_cache()
        row = {"b": b, "ctx": ctx, "impl": "split_kv", "stages": stages, "us": us}
        print(row, flush=True)
        result["split_kv_stages"].append(row)

with open(out_path, "w") as f:
    json.dump(result, f, indent=1)
print("wrote", out_path, file=sys.stderr)
