"""Serving with staggered arrivals: do step graphs for mixed steps of many sequences pay?

bench_engine's model (28 layers, rank-16 adapter), batch_invariant: 48 requests start, then
one more arrives every 8 steps until 112 have come (100-token prompts, 150 output tokens,
EOS ignored). Each arrival makes a mixed step: its prompt plus every running sequence's
decode row (~150 tokens of ~50 sequences). One engine per setting of
``step_graphs.SEQ_BUCKETS`` (which mixed steps replay a graph; the others run eagerly); wall
time of the whole run, and every request's tokens and logprobs against the first setting's.

    PYTHONPATH=src python benchmarks/experiments/staggered_arrivals.py OUT.json [--many]

``--many``: 144 requests start, then one every 8 steps until 208 (~150-200 running, past the
64-sequence bucket), with step graphs for up to 64 against up to 256 sequences.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import detlora.engine.step_graphs as sg
from benchmarks.harness import results_meta
from detlora.lora.request import LoRARequest
from detlora.study import bench_engine as be

START, TOTAL, EVERY = 48, 112, 8
SETTINGS = {"seqs_1_4_16": (1, 4, 16), "seqs_1_4_16_64": (1, 4, 16, 64)}
MANY = (144, 208, {"seqs_to_64": (1, 4, 16, 64), "seqs_to_256": (1, 4, 16, 64, 128, 256)})


def serve(llm, w) -> tuple[float, dict, int]:
    eng = llm.engine
    lora = w.loras[0]
    added, steps, done = 0, 0, {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while added < START:
        eng.add_request(w.prompts[added % len(w.prompts)], w.params[added % len(w.params)],
                        lora=lora, request_id=str(added))
        added += 1
    while eng.has_unfinished() or added < TOTAL:
        if added < TOTAL and steps % EVERY == 0:
            eng.add_request(w.prompts[added % len(w.prompts)],
                            w.params[added % len(w.params)], lora=lora,
                            request_id=str(added))
            added += 1
        for out in eng.step():
            done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
        steps += 1
    torch.cuda.synchronize()
    return time.perf_counter() - t0, done, steps


def main(out_path: str, many: bool = False) -> None:
    global START, TOTAL, SETTINGS
    if many:
        START, TOTAL, SETTINGS = MANY
    plan = be.BenchPlan()
    rows, ref = [], None
    with tempfile.TemporaryDirectory(prefix="detlora-arrivals-") as tmp:
        root = Path(tmp)
        be.write_model(root / "model", plan.shape)
        be.write_adapter(root / "adapter0", plan.shape, seed=10)
        w = be._Workload(plan, [LoRARequest("a0", 1, str(root / "adapter0"))])
        original = sg.SEQ_BUCKETS
        for label, seqs in SETTINGS.items():
            sg.SEQ_BUCKETS = seqs
            try:
                t0 = time.perf_counter()
                llm = be._engine(root / "model", "batch_invariant", plan)
                init = time.perf_counter() - t0
                serve(llm, w)  # warm-up: every bucket's first replay
                times = []
                for _ in range(2):
                    seconds, done, steps = serve(llm, w)
                    times.append(seconds)
            finally:
                sg.SEQ_BUCKETS = original
            differing = None if ref is None else sum(done[k] != ref[k] for k in ref)
            ref = ref or done
            tokens = sum(len(v[0]) for v in done.values())
            rows.append({"setting": label, "seq_buckets": list(seqs), "init_s": round(init, 1),
                         "steps": steps, "seconds": [round(t, 3) for t in times],
                         "output_tok_per_s": round(tokens / min(times), 1),
                         "differing_from_first": differing})
            print(rows[-1], flush=True)
            del llm
            be._free_gpu()
    with open(out_path, "w") as f:
        json.dump({"meta": results_meta("python benchmarks/experiments/staggered_arrivals.py "
                                        "OUT.json" + (" --many" if many else "")),
                   "workload": {"start": START, "total": TOTAL, "every": EVERY},
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], many="--many" in sys.argv[2:])
