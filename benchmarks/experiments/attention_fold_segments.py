"""Decode latency of the batch-invariant paged attention with its split-KV fold loading eight
partials at a time, for KV segments of 512 (the default) and 256 positions, beside the
split-KV kernel that is not invariant; Llama-3.2-3B heads (24 q / 8 kv of 128). CUDA-graph
replays, median per call. Segment length changes bits, so 256 is timed only.

    PYTHONPATH=src python -m benchmarks.experiments.attention_fold_segments OUT.json
"""

import sys

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us
from benchmarks.suites import attention as ba


def main(out_path: str) -> None:
    hq, hk, d = ba.MODELS["llama3b"]
    device = torch.device("cuda")
    rows = []
    for b, ctx in ((1, 1024), (1, 8192), (1, 32768), (16, 8192), (64, 256), (64, 1024)):
        for impl, segment in (("split_kv", None), ("detlora", 512), ("detlora", 256)):
            kw = {} if segment is None else {"kv_split": segment}
            calls = ba.decode_calls(impl, b, ctx, hq, hk, d, device, **kw)
            us = time_graph_us(calls, replays=10)
            del calls
            torch.cuda.empty_cache()
            rows.append({"b": b, "ctx": ctx, "impl": impl, "segment": segment,
                         "us": round(us, 2)})
            print(rows[-1], flush=True)
    meta = results_meta("python -m benchmarks.experiments.attention_fold_segments OUT.json")
    write_results(out_path, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1])
