"""Does applying penalties wait for the GPU? With the stream kept busy (a ~20 ms sleep kernel
queued first), an op that only queues work returns at once; one that synchronizes returns
after the sleep. Batch 64, vocabulary 128256, 100 prompt and 75 output ids per row, each row's
last token pending on the device (a step launched ahead): each statement of
``logit_adjust._apply_penalties`` alone, then the whole ``apply_adjustments``.

    PYTHONPATH=src python benchmarks/experiments/penalty_sync_probe.py OUT.json
"""

import json
import random
import sys
import time

import torch

from benchmarks.harness import results_meta
from detlora.config import SamplingParams
from detlora.engine import logit_adjust as la
from detlora.engine.copy_fence import PinnedStaging
from detlora.engine.sampler import _adjust_tensors, _pack_adjustments, _Upload

ROWS, VOCAB = 64, 128256


def _host_ms(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(40_000_000)  # ~20 ms of GPU time queued ahead of fn's work
    t0 = time.perf_counter()
    fn()
    ms = 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(ms, 3)


def main(out_path: str) -> None:
    rng = random.Random(0)
    params = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
    rows = [(i, la.row_adjust(params, [rng.randrange(VOCAB) for _ in range(100)],
                              [rng.randrange(VOCAB) for _ in range(75)] + [-1], i))
            for i in range(ROWS)]
    up = _Upload()
    sections = _pack_adjustments(up, rows)
    dev = up.send(torch.device("cuda"), PinnedStaging())
    fed = torch.randint(0, VOCAB, (ROWS,), device="cuda")
    t = _adjust_tensors(dev, sections, fed)
    x = torch.randn(ROWS, VOCAB, device="cuda")
    sub = x[t.penalized_rows]
    counts = torch.zeros_like(sub)
    rows_o = la._rows_of(t.output_lens, t.output_tokens.numel())
    rows_p = la._rows_of(t.prompt_lens, t.prompt_tokens.numel())
    token = t.fed[t.pending_src].long()
    seen = counts > 0
    steps = {
        "gather_rows": lambda: x[t.penalized_rows],
        "zeros_like": lambda: torch.zeros_like(sub),
        "rows_of_outputs": lambda: la._rows_of(t.output_lens, t.output_tokens.numel()),
        "count_outputs_index_put_accumulate": lambda: counts.index_put_(
            (rows_o, t.output_tokens), torch.ones_like(rows_o, dtype=sub.dtype),
            accumulate=True),
        "fed_token": lambda: t.fed[t.pending_src].long(),
        "count_pending_index_put_accumulate": lambda: counts.index_put_(
            (t.pending_rows, token), torch.ones_like(token, dtype=sub.dtype), accumulate=True),
        "seen_gt": lambda: counts > 0,
        "seen_prompt_setitem_true": lambda: seen.__setitem__((rows_p, t.prompt_tokens), True),
        "penalize": lambda: la._penalize(sub, t.repetition[:, None], t.frequency[:, None],
                                         t.presence[:, None], counts),
        "scatter_rows": lambda: x.__setitem__(t.penalized_rows, torch.where(seen, sub, sub)),
        "apply_adjustments": lambda: la.apply_adjustments(x, t),
    }
    result = {}
    for name, fn in steps.items():
        fn()  # warm: first-call costs out of the way
        result[name] = [_host_ms(fn) for _ in range(3)]
        print(name, result[name], flush=True)
    with open(out_path, "w") as f:
        json.dump({"meta": results_meta("python benchmarks/experiments/penalty_sync_probe.py "
                                        "OUT.json"), "sleep_note": "~20 ms queued before each",
                   "host_ms": result}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
