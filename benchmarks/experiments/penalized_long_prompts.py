"""Penalized requests with long prompts: host time per decode step and decode throughput.

Penalties read every prompt and output id of their rows at every step, and the host converts
each of them from a Python int again each step (~9 ms at batch 64 with 4k-token prompts on our
CPU). Commit e626f9d converted each id once instead (TokenIdArray); it was reverted because it
slowed 100-token penalized rows in 2 of 3 runs (token_id_array_ab.json). ``label`` names a run.

Measured (penalized_long_prompts.json: main's path; *_token_id_array_e626f9d.json): penalized
decode 3,548 tok/s with 15.0 ms of host time a step (plain rows 5,331), against 5,086 tok/s and
3.5 ms with TokenIdArray.

bench_engine's model (Llama-3.2-3B shape, rank-16 adapter), batch_invariant, 64 requests of
PROMPT_LEN random tokens, half greedy and half sampled (top_p 0.95), EOS ignored; plain and
penalized (repetition 1.1, frequency 0.2, presence 0.1). Decode throughput is
64 * (OUT - 1) tokens over (time with OUT tokens - time with 1 token), medians of 2 trials
after a warm-up; host ms per step is the time spent building the rows' sampling requests and
launching the sampler (``_sample_request`` and ``Sampler.launch``) over the decode steps.

    PYTHONPATH=src python benchmarks/experiments/penalized_long_prompts.py OUT.json [label]
"""

import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import results_meta
from detlora.config import SamplingParams
from detlora.lora.request import LoRARequest
from detlora.study import bench_engine as be

N, PROMPT_LEN, OUT = 64, 4000, 101


def _params(k: int, max_tokens: int, penalized: bool) -> SamplingParams:
    extra = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1) \
        if penalized else {}
    sampled = dict(temperature=0.8, top_p=0.95, seed=k) if k % 2 else {}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0, **sampled, **extra)


class _HostClock:
    """Seconds spent in the engine's per-row request building and the sampler's launch."""

    def __init__(self, engine) -> None:
        self.seconds = 0.0
        for obj, name in ((engine, "_sample_request"), (engine.sampler, "launch")):
            setattr(obj, name, self._timed(getattr(obj, name)))

    def _timed(self, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def _timed_run(llm, clock, prompts, lora, max_tokens, penalized) -> tuple[float, float]:
    params = [_params(k, max_tokens, penalized) for k in range(N)]
    torch.cuda.synchronize()
    host0 = clock.seconds
    t0 = time.perf_counter()
    llm.generate(prompts, params, lora, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, clock.seconds - host0


def main(out_path: str, label: str = "", shape: be.ModelShape | None = None) -> None:
    plan = dataclasses.replace(be.BenchPlan(), prompt_len=PROMPT_LEN, output_len=OUT,
                               shape=shape or be.ModelShape())
    rows = []
    with tempfile.TemporaryDirectory(prefix="detlora-long-penalized-") as tmp:
        root = Path(tmp)
        be.write_model(root / "model", plan.shape)
        be.write_adapter(root / "adapter0", plan.shape, seed=10)
        lora = [LoRARequest("a0", 1, str(root / "adapter0"))] * N
        llm = be._engine(root / "model", "batch_invariant", plan, max_num_seqs=N)
        clock = _HostClock(llm.engine)
        g = torch.Generator().manual_seed(7)
        prompts = torch.randint(10, plan.shape.vocab - 10, (N, PROMPT_LEN), generator=g).tolist()
        for penalized in (False, True):
            _timed_run(llm, clock, prompts, lora, OUT, penalized)  # warm-up
            full = [_timed_run(llm, clock, prompts, lora, OUT, penalized) for _ in range(2)]
            first = [_timed_run(llm, clock, prompts, lora, 1, penalized) for _ in range(2)]
            decode_s = statistics.median(f[0] for f in full) - statistics.median(
                f[0] for f in first)
            host_s = statistics.median(f[1] for f in full) - statistics.median(
                f[1] for f in first)
            rows.append({"penalized": penalized,
                         "decode_tok_per_s": round(N * (OUT - 1) / decode_s, 1),
                         "decode_ms_per_step": round(decode_s / (OUT - 1) * 1e3, 3),
                         "host_ms_per_step": round(host_s / (OUT - 1) * 1e3, 3),
                         "full_s": [round(f[0], 3) for f in full],
                         "first_token_s": [round(f[0], 3) for f in first]})
            print(label, rows[-1], flush=True)
    meta = results_meta("python benchmarks/experiments/penalized_long_prompts.py OUT.json "
                        + label)
    if label:
        meta["label"] = label
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "plan": {"requests": N, "prompt_len": PROMPT_LEN,
                                          "output_tokens": OUT, "determinism": "batch_invariant"},
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
