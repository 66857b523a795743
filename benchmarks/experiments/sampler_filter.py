"""One-off GPU experiment, kept as the record of benchmarks/results/sampler_filter.json: the
sampler's top-k / top-p filter without a sort (``rank_cut``: radix selection on the logits'
bits, 4-bit digits, exact integer weight sums per digit, then ``cut_filter``) against the
stable torch.sort that the filter starts from, CUDA-graph replay medians. It ran at b750562;
rank_cut was not kept (it was no faster than the sort: 232 vs 239 us for 32 bf16 rows of
128256), so run it from that commit to repeat it. What was kept is ranking in bf16 (the
sort of 32 fp32 rows took 337 us).

    PYTHONPATH=src OUT=out python benchmarks/experiments/sampler_filter.py
"""

# ruff: noqa: I001 (detlora.ops.rank_cut exists at b750562 only)
import json
import os

import torch

from benchmarks.harness import results_meta
from detlora.engine.token_filter import filter_logits
from detlora.ops.rank_cut import rank_cut
from detlora.ops.softmax import log_softmax
from benchmarks.harness.timing import time_graph_us

VOCAB = 128256
rows = []
for n in (32, 128):
    g = torch.Generator(device="cuda").manual_seed(n)
    base = (torch.randn(n, VOCAB, device="cuda", generator=g) * 1.1).to(torch.bfloat16)
    temps = torch.full((n,), 0.8, device="cuda")
    limit = torch.full((n,), int(0.95 * 2**40), dtype=torch.int64, device="cuda")
    top_k = torch.full((n,), 50, dtype=torch.int64, device="cuda")
    probs = torch.exp(log_softmax(base.float() / 0.8))
    for dtype in (torch.bfloat16, torch.float32):
        logits = base.to(dtype)
        def cases(x=logits, t=temps, lim=limit, k=top_k, p=probs):
            return {
                "filter top_p (rank_cut)": lambda: filter_logits(
                    x, t, None, lim, log_softmax=log_softmax, kernels=True),
                "filter top_k+top_p (rank_cut)": lambda: filter_logits(
                    x, t, k, lim, log_softmax=log_softmax, kernels=True),
                "rank_cut top_p alone": lambda: rank_cut(x, p, lim),
                "rank_cut top_k alone": lambda: rank_cut(x, None, k),
                "torch.sort stable (the previous filter's first step)": lambda: torch.sort(
                    x, dim=-1, descending=True, stable=True),
            }

        for name, fn in cases().items():
            us = time_graph_us([fn], replays=20)
            rows.append({"rows": n, "vocab": VOCAB, "dtype": str(dtype).split(".")[1],
                         "case": name, "us": round(us, 2)})
            print(rows[-1], flush=True)
out = os.path.join(os.environ.get("OUT", "out"), "sampler_filter.json")
os.makedirs(os.path.dirname(out), exist_ok=True)
with open(out, "w") as f:
    json.dump({"meta": results_meta("python benchmarks/experiments/sampler_filter.py"),
               "latency": rows}, f, indent=1)
