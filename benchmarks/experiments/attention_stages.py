"""Pipeline depth (num_stages) of the batch-invariant paged attention's 64-row, 4-warp tile:
stages change when K/V copies are issued, never the arithmetic, so any depth keeps the bits.
Decode steps on Llama-3.2-3B heads (split-KV path at batch 1 and 16, unsplit at 64),
CUDA-graph replay median per call; bits: each depth's first output against depth 3's.

    PYTHONPATH=src python benchmarks/experiments/attention_stages.py OUT.json
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
SHAPES = ((1, 1024), (1, 8192), (1, 32768), (16, 8192), (64, 256), (64, 1024))
default = pa.tile_config
rows = []
for b, ctx in SHAPES:
    ref = None
    for stages in (3, 2, 4, 5):
        cfg = default(d, hq // hk)
        pa.tile_config = lambda head_dim, group, s=stages, c=cfg: pa.TileConfig(
            c.block_m, c.num_warps, s)
        try:
            calls = ba._decode_calls("detlora", b, ctx, hq, hk, d, device)
            out = calls[0]().clone()
            ref = out if ref is None else ref
            us, err = time_graph_us(calls, replays=10), None
        except Exception as exc:  # too deep for shared memory: data, not a crash
            us, err, out = None, repr(exc)[:200], None
        finally:
            pa.tile_config = default
        rows.append({"b": b, "ctx": ctx, "stages": stages, "us": us and round(us, 2),
                     "equal_to_3": None if out is None else bool(torch.equal(out, ref)),
                     "error": err})
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
with open(sys.argv[1], "w") as f:
    json.dump({"meta": results_meta("python benchmarks/experiments/attention_stages.py"),
               "rows": rows}, f, indent=1)
