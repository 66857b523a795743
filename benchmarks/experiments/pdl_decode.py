"""Programmatic dependent launch (ops/pdl.py) on the engine's decode: on against off.

For batch_invariant and run_to_run on the engine benchmark's model (Llama-3.2-3B shape, random
bf16 weights, rank-16 adapter on all seven projections), with ``DETLORA_PDL=0`` and with PDL:
batch-1 TPOT and batch-64 tok/s (as suites.engine measures them), one decode graph replay at
batch 1 and 64 (CUDA events, median), the batch-1 replay's kernel timeline (idle time on the
main stream), and the 64 prompts' tokens and logprobs compared with those of plain launches.

Earlier rounds also launched the batch-invariant matmul with PDL, in variants (triggering after
its K loop or not, prefetching 16-192 KB of its weight tile into L2 before its wait or not):
``pdl_decode_variants_1.json`` (at ba124ca) and ``_2.json`` (at 01b188b). Each slowed the
batch-1 replay, so the matmul launches plainly.

    PYTHONPATH=src python -m benchmarks.experiments.pdl_decode OUT.json
"""

import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks.harness import results_meta, write_results
from benchmarks.suites import engine as be
from benchmarks.suites import profile_engine as pe
from detlora import LoRARequest

PLAN = replace(be.BenchPlan(), throughput_batches=(1, 64))
MODES = ("batch_invariant", "run_to_run")


def measure(root: Path, w: "be.Workload", mode: str, on: bool) -> tuple[dict, list]:
    os.environ["DETLORA_PDL"] = "1" if on else "0"
    llm = be.make_engine(root / "model", mode, PLAN)
    row: dict = {"mode": mode, "pdl": on}
    for t in be.throughput_rows(llm, mode, w, print):
        row[f"b{t['batch']}"] = {k: t[k] for k in ("output_tok_per_s", "tpot_ms")}
    graphs = llm.engine.runner.graphs
    for b in (1, 64):
        row[f"replay_us_b{b}"] = round(pe.event_us(graphs.graphs[graphs.bucket_for(b)].replay,
                                                    reps=50), 1)
    tl = pe.stream_timeline(graphs.graphs[graphs.bucket_for(1)].replay)
    row["timeline_b1"] = {k: tl[k] for k in ("main_span_us", "main_idle_us")}
    outs = w.generate(llm, list(range(PLAN.prompts)))
    print(json.dumps(row), flush=True)
    del llm, graphs  # the graphs hold the model's memory too
    be.free_gpu()
    return row, outs


def main(out_path: str) -> None:
    rows, bits = [], []
    with tempfile.TemporaryDirectory(prefix="detlora-pdl-") as tmp:
        root = Path(tmp)
        be.write_model(root / "model", PLAN.shape)
        for k in range(2):
            be.write_adapter(root / f"adapter{k}", PLAN.shape, seed=10 + k)
        loras = [LoRARequest(f"a{k}", k + 1, str(root / f"adapter{k}")) for k in range(2)]
        w = be.Workload(PLAN, loras)
        for mode in MODES:
            got = {}
            for on in (False, True):
                row, got[on] = measure(root, w, mode, on)
                rows.append(row)
            bits.append({"mode": mode, "prompts": PLAN.prompts,
                         "differing": be.count_differing(got[True], got[False])})
            print(bits[-1], flush=True)
    result = {"meta": results_meta("python -m benchmarks.experiments.pdl_decode OUT.json"),
              "rows": rows, "bits_pdl_vs_plain": bits}
    write_results(out_path, result)


if __name__ == "__main__":
    main(sys.argv[1])
