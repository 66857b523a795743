"""``LLM(tensor_parallel_size=N)`` on the CPU: N - 1 spawned worker processes joined by gloo,
rank 0 in the test's process. At batch_invariant every output (tokens, logprobs, prompt
logprobs, fingerprint) equals the one-process engine's bit for bit, with mixed adapters,
greedy and seeded sampling, preemption (a KV cache too small for the batch), prefix caching
and run-ahead decode; a worker that dies makes the engine fail with an error naming its
rank instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import pytest
from tests.helpers.engine_outputs import random_prompts, same_outputs

from detlora.config import SamplingParams
from detlora.distributed.workers import WorkerDied
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

# One xdist worker runs them all (pyproject's addopts: --dist loadgroup), so each engine of
# the module-scoped fixtures starts once.
pytestmark = pytest.mark.xdist_group("tensor_parallel_engines")

N = 6
BLOCKS = 9  # pages of 16 tokens: fewer than the batch needs, so sequences get preempted


def _llm(model_dir, size, **kw) -> LLM:
    return LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
               tensor_parallel_size=size, num_kv_blocks=BLOCKS, **kw)


@pytest.fixture(scope="module")
def requests(llama_adapters):
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(llama_adapters)]
    prompts = random_prompts(N, seed=31, lo=8, hi=40)
    mixed = [loras[k % 2] if k % 3 else None for k in range(N)]
    params = [
        SamplingParams(max_tokens=10, logprobs=2, ignore_eos=True, temperature=0.0,
                       prompt_logprobs=1 if k == 0 else None) if k % 2 == 0 else
        SamplingParams(max_tokens=10, logprobs=0, ignore_eos=True, temperature=0.9, top_p=0.9,
                       seed=50 + k)
        for k in range(N)
    ]
    return prompts, params, mixed


LONG = list(range(2, 50))  # three full pages: the prefix cache keeps two
LONG_PARAMS = SamplingParams(max_tokens=4, logprobs=1, temperature=0.0)


@pytest.fixture(scope="module")
def reference(llama_dir, requests):
    llm = _llm(llama_dir, 1)
    outs = llm.generate(*requests, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0  # the small cache preempts
    return outs, llm.generate(LONG, LONG_PARAMS, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def tp2(llama_dir):
    llm = _llm(llama_dir, 2)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def tp4(llama_dir):
    llm = _llm(llama_dir, 4)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(params=["tp2", "tp4"])
def parallel(request):
    """The TP 2 and TP 4 engines, each started once for the module (both alive at once: a
    test order that alternates between them starts no engine twice)."""
    return request.getfixturevalue(request.param)


def _assert_same(outs, ref):
    for k, (a, b) in enumerate(zip(outs, ref, strict=True)):
        assert same_outputs(a, b), f"request {k}: tokens or logprobs differ"
        assert a.prompt_logprobs == b.prompt_logprobs, f"request {k}: prompt logprobs differ"
        assert a.fingerprint == b.fingerprint


def test_outputs_equal_one_process_bit_for_bit(parallel, requests, reference):
    engine = parallel.engine
    assert len(engine.tp_driver.worker_pids) == engine.tp_driver.size - 1
    outs = parallel.generate(*requests, use_tqdm=False)
    _assert_same(outs, reference[0])
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_keep_the_bits(parallel, reference):
    first, again = (parallel.generate(LONG, LONG_PARAMS, use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens == 32 and first.num_cached_tokens == 0
    _assert_same([first, again], [reference[1]] * 2)


def test_run_ahead_decode_shares_the_sampled_tokens(parallel, requests, reference):
    """Steps launched before the previous one is read take their input ids from the tokens
    rank 0 sampled, broadcast to every rank."""
    parallel.engine.run_ahead = True
    try:
        outs = parallel.generate(*requests, use_tqdm=False)
        assert parallel.engine.num_steps_ahead > 0
    finally:
        parallel.engine.run_ahead = False
    _assert_same(outs, reference[0])


def test_a_dead_worker_fails_the_engine_naming_its_rank(llama_dir, requests):
    llm = _llm(llama_dir, 2)
    try:
        (pid,) = llm.engine.tp_driver.worker_pids.values()
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDied, match="rank 1"):
            llm.generate(*requests, use_tqdm=False)
        with pytest.raises(WorkerDied, match="rank 1"):  # and stays failed
            llm.generate(*requests, use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        llm.engine.shutdown()


def test_sizes_that_cannot_split_the_model_are_refused(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size must be one of"):
        _llm(llama_dir, 3)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        _llm(llama_dir, 8)


def test_a_worker_killed_during_a_step_fails_the_engine(llama_dir, requests):
    """Killed between the driver's command and the step's collectives: the driver's gather
    fails at once (gloo) and the error names the rank."""
    llm = _llm(llama_dir, 2)
    try:
        (pid,) = llm.engine.tp_driver.worker_pids.values()
        local = llm.engine.runner.local
        execute, calls = local.execute, []

        def kill_on_third_step(step, decode_only):
            calls.append(1)
            if len(calls) == 3:
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.5)
            return execute(step, decode_only)

        local.execute = kill_on_third_step
        with pytest.raises(WorkerDied, match=r"rank 1 exited with code -9"):
            llm.generate(*requests, use_tqdm=False)
        assert len(calls) == 3
    finally:
        llm.engine.shutdown()


def test_torchrun_launch_gives_the_same_bits(llama_dir, llama_adapters):
    """Every rank runs the script; rank 0's engine drives, rank 1 serves it from inside
    LLM(...) and exits when it shuts down."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "helpers" / "torchrun_generate.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(script), str(llama_dir), str(llama_adapters[0])],
        capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu")
    want = llm.generate([[5, 6, 7, 8], [9, 10, 11, 12, 13]],
                        SamplingParams(max_tokens=6, logprobs=1, ignore_eos=True, temperature=0.0),
                        [LoRARequest("a", 1, str(llama_adapters[0])), None], use_tqdm=False)
    assert got == [[o.outputs[0].token_ids,
                    [{str(k): [v.logprob, v.rank] for k, v in d.items()}
                        for d in o.outputs[0].logprobs]]
                   for o in want]


def test_serve_with_tensor_parallel_size_two(tmp_path):
    """``detlora serve --tensor-parallel-size 2``: the engine's process starts its worker, and
    a completion (through the openai client) has the one-process engine's bits."""
    from openai import OpenAI
    from tests.helpers.server import running_server
    from tests.helpers.tiny_chat_model import build_tiny_chat_model

    model, _ = build_tiny_chat_model(tmp_path)
    sp = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=1)
    ref = LLM(str(model), device="cpu").generate("yes no maybe", sp, use_tqdm=False)[0]
    with running_server(model, ["--tensor-parallel-size", "2", "--max-model-len", "256"]) as (
            url, _):
        out = OpenAI(base_url=url + "/v1", api_key="unused").completions.create(
            model=str(model), prompt="yes no maybe", max_tokens=8, temperature=0.8, seed=3,
            logprobs=1, extra_body={"return_token_ids": True})
    choice, want = out.choices[0], ref.outputs[0]
    assert choice.model_extra["token_ids"] == want.token_ids
    assert choice.logprobs.token_logprobs == [d[t].logprob for d, t in zip(
        want.logprobs, want.token_ids, strict=True)]
    assert out.system_fingerprint == ref.fingerprint
