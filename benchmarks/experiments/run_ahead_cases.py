"""What running one step ahead gains in the two cases it newly covers: rows with penalties,
and requests queueing for a sequence slot.

suites.engine's model (Llama-3.2-3B shape, 28 layers, rank-16 adapter), batch_invariant, one
engine with 64 sequence slots; 100-token prompts, 150 output tokens, EOS ignored, half the
rows greedy and half sampled. Cases:
- ``plain_b64``: 64 requests without penalties (the case run-ahead always covered);
- ``penalized_b64``: the same 64 with repetition 1.1, frequency 0.2, presence 0.1;
- ``queued_256``: 256 requests for the 64 slots (no penalties).
Each case runs with ``run_ahead`` on and off (off: every step waits for the host to read the
previous one): wall time (median of 3 after a warm-up), output tok/s, steps launched ahead,
and the requests whose tokens or logprobs differ between on and off (batch_invariant: 0).

    PYTHONPATH=src python -m benchmarks.experiments.run_ahead_cases OUT.json
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.suites import engine as be
from detlora import LoRARequest, SamplingParams

SLOTS = 64


def _params(k: int, plan: be.BenchPlan, penalized: bool) -> SamplingParams:
    extra = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1) \
        if penalized else {}
    sampled = dict(temperature=0.8, top_p=0.95, seed=k) if k % 2 else dict(temperature=0.0)
    return SamplingParams(max_tokens=plan.output_len, ignore_eos=True, logprobs=0,
                          **sampled, **extra)


def _case(llm, w: be.Workload, n: int, penalized: bool, ahead: bool) -> dict:
    engine = llm.engine
    engine.run_ahead = ahead
    prompts = [w.prompts[k % len(w.prompts)] for k in range(n)]
    params = [_params(k, w.plan, penalized) for k in range(n)]
    lora = [w.loras[0]] * n

    def go() -> list:
        return llm.generate(prompts, params, lora, use_tqdm=False)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    go()  # warm-up: this case's shapes
    before = engine.num_steps_ahead
    times, outs = [], None
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        outs = go()
        sync()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"run_ahead": ahead, "trials_s": [round(t, 4) for t in times],
            "output_tok_per_s": round(n * w.plan.output_len / seconds, 1),
            "steps_ahead_per_run": (engine.num_steps_ahead - before) / 3,
            "outputs": outs}


def main(out_path: str, plan: be.BenchPlan | None = None) -> None:
    plan = plan or be.BenchPlan()
    rows = []
    with tempfile.TemporaryDirectory(prefix="detlora-run-ahead-") as tmp:
        root = Path(tmp)
        be.write_model(root / "model", plan.shape)
        be.write_adapter(root / "adapter0", plan.shape, seed=10)
        w = be.Workload(plan, [LoRARequest("a0", 1, str(root / "adapter0"))])
        llm = be.make_engine(root / "model", "batch_invariant", plan, max_num_seqs=SLOTS)
        if torch.cuda.is_available():
            assert llm.engine.run_ahead, llm.engine.runner.graph_error
        for case, n, penalized in (("plain_b64", SLOTS, False), ("penalized_b64", SLOTS, True),
                                   ("queued_256", 4 * SLOTS, False)):
            on, off = (_case(llm, w, n, penalized, ahead) for ahead in (True, False))
            differing = be.count_differing(on.pop("outputs"), off.pop("outputs"))
            rows.append({"case": case, "requests": n, "slots": SLOTS, "penalized": penalized,
                         "on": on, "off": off,
                         "speedup": round(on["output_tok_per_s"] / off["output_tok_per_s"], 3),
                         "differing_on_vs_off": differing})
            print(rows[-1], flush=True)
    meta = results_meta("python -m benchmarks.experiments.run_ahead_cases OUT.json")
    write_results(out_path, {"meta": meta,
                             "plan": {"model": "Llama-3.2-3B shape, random bf16", "rank": 16,
                                      "prompt_len": plan.prompt_len,
                                      "output_len": plan.output_len,
                                      "determinism": "batch_invariant", "slots": SLOTS},
                             "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1])
