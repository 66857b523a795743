"""How many CTAs should share a decode tile's KV segments, now that decode steps run on the
16-row tile (more CTAs fit an SM than with the 64-row one)? Decode latency of the
batch-invariant attention (max_query_len 1, Llama-3.2-3B heads) for a range of fixed
``kv_ctas`` against the default rule, CUDA-graph replays. ``kv_ctas`` never changes bits.

    PYTHONPATH=src python -m benchmarks.experiments.attention_decode_ctas OUT.json
"""

import sys

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us
from benchmarks.suites import attention as ba
from detlora.ops import paged_attention as pa


def main(out_path: str) -> None:
    hq, hk, d = ba.MODELS["llama3b"]
    device = torch.device("cuda")
    rows = []
    meta = {**results_meta("python -m benchmarks.experiments.attention_decode_ctas OUT.json"),
            "note": "decode tile (16 rows, 4 warps); kv_ctas fixed vs the default rule "
                    "(default_kv_ctas, capped by the segment count)"}
    for b in (1, 4, 8, 16, 32, 64):
        for ctx in (1024, 8192, 32768):
            segs = -(-ctx // pa.KV_SEGMENT)
            choices = [None] + [c for c in (1, 2, 3, 4, 6, 8, 12, 16, 24, 33)
                                if c <= segs and b * hk * c <= 1100]
            for ctas in choices:
                calls = ba.decode_calls("detlora", b, ctx, hq, hk, d, device, kv_ctas=ctas)
                us = time_graph_us(calls, replays=10)
                del calls
                torch.cuda.empty_cache()
                default = min(pa.default_kv_ctas(b * hk, 0), segs)
                rows.append({"b": b, "ctx": ctx, "kv_ctas": ctas or f"default ({default})",
                             "us": round(us, 2)})
                print(rows[-1], flush=True)
    write_results(out_path, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1])
