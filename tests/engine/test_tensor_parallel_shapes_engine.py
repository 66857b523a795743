"""``LLM(tensor_parallel_size=N)`` on the CPU on shapes that do not split into powers of two
(issue 50): the reported 96 x 200 model at TP 2 gives TP 1's tokens, logprobs and fingerprint
bit for bit (greedy and seeded sampling), while below batch_invariant the fingerprint names
the size; a size the shapes cannot keep is refused at engine start, naming the dimension and
the sizes that keep the bits; and a script that builds its engine at module level, without
the ``__main__`` guard, is told what to add."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from tests.helpers.engine_outputs import random_prompts, same_outputs
from tests.helpers.tiny_hf import write_random_checkpoint

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM

pytestmark = pytest.mark.xdist_group("tensor_parallel_engines")


def _model(path, **shape):
    return write_random_checkpoint(path, "llama", vocab_size=285, num_key_value_heads=2,
                                   **shape)


def test_the_reported_shape_gives_one_process_outputs(tmp_path):
    base = _model(tmp_path / "m", hidden_size=96, intermediate_size=200, num_attention_heads=4)
    prompts = random_prompts(12, seed=5, lo=4, hi=30)
    params = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1, temperature=0.0)
              if k % 2 == 0 else
              SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1, temperature=0.9,
                             seed=k) for k in range(len(prompts))]
    want = LLM(str(base), device="cpu", skip_tokenizer_init=True).generate(
        prompts, params, use_tqdm=False)
    llm = LLM(str(base), device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert same_outputs(a, b), f"request {k}: tokens or logprobs differ"
        assert a.fingerprint == b.fingerprint


def test_below_batch_invariant_the_fingerprint_names_the_size(tmp_path):
    """run_to_run all-reduces rounded partial outputs, so its bits follow the size: equal
    fingerprints there would promise bits that differ."""
    base = _model(tmp_path / "m", hidden_size=96, intermediate_size=200, num_attention_heads=4)
    kw = dict(device="cpu", skip_tokenizer_init=True, determinism="run_to_run")
    one = LLM(str(base), **kw).engine.fingerprint_of(None)
    llm = LLM(str(base), tensor_parallel_size=2, **kw)
    try:
        assert llm.engine.fingerprint_of(None) != one
    finally:
        llm.engine.shutdown()


def test_a_size_the_shapes_cannot_keep_is_refused_at_start(tmp_path):
    base = _model(tmp_path / "m", hidden_size=192, intermediate_size=520,
                  num_attention_heads=6)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 cannot run this model with "
                       r"one device's bits: num_attention_heads=6 does not split evenly over 4 "
                       r"ranks.*Sizes that keep them: 1, 2$"):
        LLM(str(base), device="cpu", skip_tokenizer_init=True, tensor_parallel_size=4)
    assert time.monotonic() - start < 30  # before any worker starts


SCRIPT = """
import sys
from detlora.entrypoints.llm import LLM

llm = LLM(sys.argv[1], device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2)
print("generated", llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids)
"""


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    """The spawned worker re-runs the script, meets LLM(...) at module level and stops at
    once; the driver's error says what to add instead of 'exited with code 1'."""
    base = _model(tmp_path / "m", hidden_size=96, intermediate_size=200, num_attention_heads=4)
    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, str(script), str(base)], capture_output=True,
                          text=True, timeout=240, env=env, check=False, cwd=tmp_path)
    assert proc.returncode == 1 and "generated" not in proc.stdout
    last = proc.stderr.strip().splitlines()
    assert "WorkerDied: tensor-parallel worker rank 1 stopped while re-running your script" \
        in proc.stderr, proc.stderr[-3000:]
    assert 'if __name__ == "__main__":' in proc.stderr
    assert "bootstrapping phase" not in proc.stderr  # the worker stopped before spawning
    assert last[-1].startswith("(Python's multiprocessing guide")
