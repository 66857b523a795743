"""Every bad input fails with a clear error, and a failed request leaves the engine usable."""

import json
import shutil

import pytest
from tests.helpers.engine_outputs import random_prompts

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
               max_model_len=64)


def test_missing_model_dir_and_files(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(str(tmp_path), device="cpu")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(llama_dir / "config.json", no_weights / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(no_weights), device="cpu")
    with pytest.raises(FileNotFoundError, match=r"tokenizer directory .*nope does not exist"):
        LLM(str(llama_dir), device="cpu", tokenizer=str(tmp_path / "nope"))


def test_bad_config(tmp_path, llama_dir):
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act"):
        LLM(str(bad), device="cpu")
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 96}))
    with pytest.raises(ValueError, match="shape"):
        LLM(str(bad), device="cpu")
    (bad / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        LLM(str(bad), device="cpu")
    (bad / "config.json").write_text(json.dumps(cfg))
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors"):
        LLM(str(bad), device="cpu")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(llama_dir), device="cpu", max_model_len=10_000)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(llama_dir), device="cpu", enable_chunked_prefill=False, max_num_batched_tokens=8)


def test_bad_adapters_fail_and_the_engine_recovers(llm, tmp_path, llama_adapters):
    prompt = random_prompts(1, seed=1)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises((FileNotFoundError, ValueError), match=r"adapter directory .* not exist"):
        llm.generate(prompt, sp, LoRARequest("gone", 7, str(tmp_path / "gone")), use_tqdm=False)
    wide = tmp_path / "rank"
    shutil.copytree(llama_adapters[0], wide)
    cfg = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))
    # Read when its step needs it: its own request fails, with the reason.
    out = llm.generate(prompt, sp, LoRARequest("rank", 8, str(wide)), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    assert "has rank 8 but adapter_config.json says r=4" in out.outputs[0].error
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free == llm.engine.num_kv_blocks
    ok = llm.generate(prompt, sp, LoRARequest("a0", 1, str(llama_adapters[0])), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) >= 1
    # The id of the failed load is free: the corrected path runs under it.
    fixed = llm.generate(prompt, sp, LoRARequest("gone", 7, str(llama_adapters[0])),
                         use_tqdm=False)
    assert fixed[0].outputs[0].token_ids == ok[0].outputs[0].token_ids


def test_bad_requests(llm, llama_adapters):
    prompts = random_prompts(2, seed=2)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([2] * 64, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request has 3 entries but there are 2 prompts"):
        llm.generate(prompts, sp, [None, None, None], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 1 entries"):
        llm.generate(prompts, [sp], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, 128]], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", sp, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts is empty"):
        llm.generate([], sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"unknown prompt keys \['prompt_tokens_ids'\]"):
        llm.generate({"prompt_tokens_ids": [3, 4]}, sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[1\]: unknown prompt keys \['seed'\]"):
        llm.generate([[3], {"prompt_token_ids": [3, 4], "seed": 1}], sp, use_tqdm=False)
    assert llm.generate({"prompt_token_ids": [3, 4], "prompt": "label"}, sp,
                        use_tqdm=False)[0].prompt == "label"
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(prompts, SamplingParams(temperature=0.0, top_p=2.0), use_tqdm=False)
    with pytest.raises(ValueError, match=r"logprobs=129 asks for more top tokens than the "
                                         r"vocabulary holds \(128\)"):
        llm.generate(prompts, SamplingParams(temperature=0.0,
                                             max_tokens=2, logprobs=129), use_tqdm=False)
    every = llm.generate(prompts[0], SamplingParams(temperature=0.0,
                                                    max_tokens=2, logprobs=128), use_tqdm=False)
    assert all(len(step) == 128 for step in every[0].outputs[0].logprobs)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "p")
    no_lora = LLM(str(llm.config.model), device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora=False"):
        no_lora.generate(prompts[0], sp, LoRARequest("a", 1, str(llama_adapters[0])),
                         use_tqdm=False)
    tiny_cache = LLM(str(llm.config.model), device="cpu", num_kv_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        tiny_cache.generate([3] * 20, sp, use_tqdm=False)
    # Nothing was added by any failed call.
    assert not llm.engine.has_unfinished()


def test_stop_tokens_and_min_tokens(llm):
    prompt = random_prompts(1, seed=4)[0]
    first = llm.generate(prompt, SamplingParams(temperature=0.0,
                                                max_tokens=6), use_tqdm=False)[0].outputs[0]
    stop = first.token_ids[2]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    k = first.token_ids.index(stop)
    assert out.token_ids == first.token_ids[: k + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop and first.stop_reason is None
    late = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop],
                                               min_tokens=k + 2), use_tqdm=False)[0].outputs[0]
    assert stop not in late.token_ids[: k + 2]
