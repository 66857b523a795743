"""Batch-invariant paged attention with two key blocks per loop iteration: one score dot over
128 keys, split into the two 64-key blocks' scores, then the two online-softmax updates in
order (the same arithmetic as one block per iteration). Does it cut the serial latency per
block that limits batch-1 decode, and does it keep the bits?

    PYTHONPATH=src python benchmarks/experiments/attention_block_pairs.py OUT.json

Runs at commit 85ef1d6 only: that commit's paged_attention has the ``_PAIR_BLOCKS`` flag this
script toggles. Measured there (attention_block_pairs.json): the pairs keep every bit but run
slower everywhere (batch 1, 8k: 22.3 -> 26.6 us; batch 64, 1k: 97 -> 200 us): the 64x128 score
tile and the second block's state spill registers (sm_90 ptxas: 28 -> 244 bytes split, 64 ->
544 unsplit), and Triton 3.6 still waits on each wgmma group at once, so nothing overlaps. The
flag was removed after this measurement.

Bits: rows computed with pairs (split and unsplit KV) against the same rows of one full
prefill and of decode steps computed without pairs, ``torch.equal`` per row, Llama and Qwen
heads. Latency: decode steps, Llama-3.2-3B heads, CUDA-graph replay median per call, beside
the split-KV kernel that is not invariant.
"""

import json
import sys

import torch

from benchmarks.harness import results_meta
from benchmarks.harness.timing import time_graph_us
from detlora.ops import paged_attention as pa
from detlora.study import bench_attention as ba

device = torch.device("cuda")
VARIANTS = {"one": (False, False), "pairs": (True, True)}
SHAPES = ((1, 1024), (1, 8192), (1, 32768), (16, 1024), (16, 8192), (64, 1024), (64, 8192))
saved = pa._PAIR_BLOCKS
bits, rows = [], []
try:
    for model in ("llama3b", "qwen3_0_6b"):
        hq, hk, d = ba.MODELS[model]
        length = 3000
        pool = ba._Pool([length, 1700], hq, hk, d, seed=21, device=device)
        steps = [*range(0, length, 7), length - 1]
        pa._PAIR_BLOCKS = VARIANTS["one"]
        full = pool.attend([(0, 0, length)])[0]
        ref_dec = {c: pool.attend([(0, p, p + 1) for p in steps], max_query_len=1, kv_ctas=c)
                   for c in (1, 16)}
        pa._PAIR_BLOCKS = VARIANTS["pairs"]
        cases = mism = 0
        for c in (1, 16):
            dec = pool.attend([(0, p, p + 1) for p in steps], max_query_len=1, kv_ctas=c)
            for p, r, r0 in zip(steps, dec, ref_dec[c], strict=True):
                cases += 2
                mism += int(not torch.equal(r, full[p:p + 1])) + int(not torch.equal(r, r0))
        for c in (1, 2, 7):
            got = pool.attend([(0, 0, length)], kv_ctas=c)[0]
            cases += 1
            mism += int(not torch.equal(got, full))
        mixed = pool.attend([(1, 0, 1700), (0, 2000, length)], max_query_len=1700)
        cases += 1
        mism += int(not torch.equal(mixed[1], full[2000:]))
        bits.append({"model": model, "cases": cases, "mismatches": mism})
        print(bits[-1], flush=True)
        pa._PAIR_BLOCKS = saved

    hq, hk, d = ba.MODELS["llama3b"]
    for b, ctx in SHAPES:
        calls = ba._decode_calls("split_kv", b, ctx, hq, hk, d, device)
        rows.append({"b": b, "ctx": ctx, "impl": "split_kv",
                     "us": round(time_graph_us(calls, 10), 2)})
        print(rows[-1], flush=True)
        del calls
        outs = {}
        for name, flags in VARIANTS.items():
            pa._PAIR_BLOCKS = flags
            calls = ba._decode_calls("detlora", b, ctx, hq, hk, d, device)
            outs[name] = calls[0]().clone()
            us = time_graph_us(calls, replays=10)
            pa._PAIR_BLOCKS = saved
            del calls
            torch.cuda.empty_cache()
            rows.append({"b": b, "ctx": ctx, "impl": f"detlora_{name}", "us": round(us, 2),
                         "equal_to_one": bool(torch.equal(outs[name], outs["one"]))})
            print(rows[-1], flush=True)
finally:
    pa._PAIR_BLOCKS = saved
meta = results_meta("python benchmarks/experiments/attention_block_pairs.py")
with open(sys.argv[1], "w") as f:
    json.dump({"meta": meta, "bits": bits, "rows": rows}, f, indent=1)
