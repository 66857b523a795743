"""Prefill work of an RL-style batch on a cold prefix cache, with and without waiting for pages
that a running sequence is computing (scheduler.py; BlockManager.next_page_computing).

Workload: P prompts of L tokens, n completions each (seeded sampling), all submitted at once
to a fresh batch_invariant engine with prefix caching (the default there), on the demo's tiny
random Llama. Counted, not timed (so it runs on a CPU): prompt and decode tokens the steps
computed, steps, tokens found in the cache; and every completion compared (token ids and
logprobs, ==) between the two runs.

    PYTHONPATH=src python -m benchmarks.experiments.shared_inflight_pages OUT.json
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import results_meta, write_results
from detlora import LLM, SamplingParams
from detlora.entrypoints.demo import build_demo_assets

PROMPTS, PROMPT_LEN, N, OUTPUT_LEN = 8, 160, 8, 8
BUDGETS = (512, 8192)  # max_num_batched_tokens


def run(model_dir: Path, budget: int, wait_for_pages: bool) -> tuple[dict, list]:
    llm = LLM(str(model_dir), device="cpu", max_num_batched_tokens=budget)
    engine = llm.engine
    if not wait_for_pages:  # the scheduler before: never waits for a page in flight
        engine.block_manager.next_page_computing = lambda seq, cached: False
    counts = {"steps": 0, "tokens": 0}
    schedule = engine.scheduler.schedule

    def counted():
        out = schedule()
        counts["steps"] += 1
        counts["tokens"] += out.num_tokens
        return out

    engine.scheduler.schedule = counted
    g = torch.Generator().manual_seed(0)
    vocab = engine.spec.vocab_size
    prompts = [torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist()
               for _ in range(PROMPTS)]
    params = SamplingParams(n=N, max_tokens=OUTPUT_LEN, temperature=1.0, seed=1, logprobs=0,
                            ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    row = {"max_num_batched_tokens": budget, "wait_for_pages": wait_for_pages, **counts,
           "cached_tokens": engine.block_manager.num_hit_tokens,
           "prompt_tokens_submitted": PROMPTS * N * PROMPT_LEN}
    return row, [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def main(out_path: str) -> None:
    rows, compared, differing = [], 0, 0
    with tempfile.TemporaryDirectory(prefix="detlora-inflight-") as tmp:
        model_dir, _ = build_demo_assets(Path(tmp))
        for budget in BUDGETS:
            before, a = run(model_dir, budget, wait_for_pages=False)
            after, b = run(model_dir, budget, wait_for_pages=True)
            rows += [before, after]
            compared += len(a)
            differing += sum(x != y for x, y in zip(a, b, strict=True))
    command = "python -m benchmarks.experiments.shared_inflight_pages OUT.json"
    result = {"meta": results_meta(command),
              "plan": {"prompts": PROMPTS, "prompt_len": PROMPT_LEN, "n": N,
                       "output_len": OUTPUT_LEN, "model": "detlora demo tiny Llama (CPU)"},
              "rows": rows, "completions_compared": compared,
              "completions_differing": differing}
    print(json.dumps(rows), "differing", differing)
    write_results(out_path, result)


if __name__ == "__main__":
    main(sys.argv[1])
