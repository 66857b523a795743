"""LLMEngine.abort_request: a waiting or running request is dropped, its pages freed, and the
others finish with the bits they have alone."""

import pytest
from tests.helpers.engine_outputs import random_prompts, same_outputs

from detlora.config import SamplingParams
from detlora.engine.sched.sequence import FinishReason
from detlora.entrypoints.llm import LLM


@pytest.mark.parametrize("run_ahead", [False, True])
def test_aborted_requests_leave_the_others_alone(llama_dir, run_ahead):
    llm = LLM(str(llama_dir), device="cpu", max_num_seqs=3)
    engine = llm.engine
    engine.run_ahead = run_ahead
    prompts = random_prompts(5, seed=31)
    sp = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0, temperature=0.9, seed=1)
    alone = {str(k): llm.generate(p, sp, use_tqdm=False)[0] for k, p in enumerate(prompts)}
    seqs = [engine.add_request(p, sp, request_id=str(k)) for k, p in enumerate(prompts)]
    outs = {}
    for _ in range(3):
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert seqs[1].num_output_tokens > 0 and seqs[4].num_computed == 0  # running, waiting
    engine.abort_request(["1", "4", "no-such-id"])
    assert seqs[1].finish_reason is FinishReason.ABORT and seqs[4].is_finished
    while engine.has_unfinished():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(outs) == ["0", "2", "3"]
    assert all(same_outputs(outs[k], alone[k]) for k in outs)
    assert engine.block_manager.num_free == engine.num_kv_blocks
    engine.abort_request("0")  # finished: ignored
