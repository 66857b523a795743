"""vLLM's API where users expect it: SamplingParams defaults, Logprob objects, metrics,
the Hugging Face tokenizer, vLLM's engine argument names, chat arguments, shutdown."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detlora import EngineArgs, Logprob, SamplingParams
from detlora.entrypoints.demo import build_demo_assets
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_demo_assets(tmp_path_factory.mktemp("api"))


@pytest.fixture(scope="module")
def llm(assets):
    model_dir, _ = assets
    return LLM(str(model_dir), device="cpu", enable_lora=True, max_lora_rank=8)


def test_sampling_params_defaults_are_vllms():
    p = SamplingParams()
    assert (p.temperature, p.max_tokens, p.top_p, p.n) == (1.0, 16, 1.0, 1)
    assert not p.greedy
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    assert SamplingParams(stop=None).stop_token_ids == ()
    assert SamplingParams(stop="x").stop == ("x",)


def test_logprob_objects_ranks_and_decoded_tokens(llm):
    out = llm.generate("the user asks a question and", SamplingParams(
        temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=1), use_tqdm=False)[0]
    c = out.outputs[0]
    tok = c.token_ids[0]
    first = c.logprobs[0][tok]
    assert isinstance(first, Logprob) and isinstance(first.logprob, float)
    assert first.rank == 1  # greedy: the best token
    assert first.decoded_token == llm.get_tokenizer().decode([tok])
    for entry, t in zip(c.logprobs, c.token_ids, strict=True):
        assert next(iter(entry)) == t and len(entry) in (2, 3)
        tops = list(entry.values())[1:]
        assert [v.rank for v in tops] == sorted(v.rank for v in tops)
    assert c.cumulative_logprob == sum(d[t].logprob for d, t in
                                       zip(c.logprobs, c.token_ids, strict=True))
    scored = out.prompt_logprobs
    assert scored[0] is None
    for entry, t in zip(scored[1:], out.prompt_token_ids[1:], strict=True):
        mine = entry[t]
        assert mine.rank >= 1 and mine.logprob <= 0.0
        assert all(v.decoded_token is not None for v in entry.values())


def test_metrics_and_lora_request(llm, assets):
    _, adapters = assets
    lora = LoRARequest("a", 1, str(adapters[0]))
    outs = llm.generate(["the engine reads", "a sum in floating point"],
                        SamplingParams(temperature=0.0, max_tokens=3), [lora, None],
                        use_tqdm=False)
    assert outs[0].lora_request == lora and outs[1].lora_request is None
    m = outs[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time \
        <= m.last_token_time <= m.finished_time
    assert m.time_in_queue >= 0
    # Times are left out of ==: the same request run again compares equal.
    again = llm.generate("a sum in floating point", SamplingParams(temperature=0.0,
                                                                   max_tokens=3),
                         use_tqdm=False)[0]
    assert again.outputs == outs[1].outputs and again.metrics != outs[1].metrics


def test_get_tokenizer_is_hugging_faces(llm):
    tok = llm.get_tokenizer()
    assert hasattr(tok, "apply_chat_template") and tok.decode(tok.encode("the user")) \
        .endswith("the user")


def test_vllm_engine_argument_names(assets):
    model_dir, _ = assets
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=1, trust_remote_code=True,
              quantization=None, num_gpu_blocks_override=40, swap_space=4,
              max_seq_len_to_capture=8192, disable_log_stats=True, tokenizer_mode="auto",
              seed=3)
    assert llm.engine.num_kv_blocks == 40 and llm.engine_args.seed == 3
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"max_lora_rnk": 8}, TypeError, "did you mean 'max_lora_rank'"),
    ({"tensor_paralel_size": 1}, TypeError, "did you mean 'tensor_parallel_size'"),
    ({"flux_capacitor": 1}, TypeError, "unexpected keyword argument 'flux_capacitor'"),
    ({"quantization": "awq"}, ValueError, "quantization='awq' is not supported"),
    ({"tensor_parallel_size": 3}, ValueError, r"tensor_parallel_size must be one of \[1, 2"),
    ({"pipeline_parallel_size": 2}, ValueError, "pipeline_parallel_size=2"),
    ({"kv_cache_dtype": "fp8"}, ValueError, "kv_cache_dtype='fp8' is not supported"),
    ({"cpu_offload_gb": 4}, ValueError, "cpu_offload_gb=4 is not supported"),
    ({"logprobs_mode": "raw"}, ValueError, "logprobs_mode must be one of"),
    ({"revision": "main"}, ValueError, "revision='main' applies to Hub model ids"),
    ({"num_kv_blocks": 8, "num_gpu_blocks_override": 8}, TypeError, "twice"),
])
def test_engine_arguments_it_cannot_honour_are_refused(assets, kwargs, error, message):
    model_dir, _ = assets
    with pytest.raises(error, match=message):
        LLM(str(model_dir), device="cpu", **kwargs)


def test_llm_signature_lists_the_engine_arguments():
    import inspect

    params = inspect.signature(LLM).parameters
    assert set(EngineArgs.names()) <= set(params)
    assert params["max_loras"].default == 1 and params["max_lora_rank"].default == 16


def test_token_ids_as_numpy_and_torch(llm):
    ids = [5, 6, 7, 8]
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    want = llm.generate(ids, sp, use_tqdm=False)[0].outputs[0].token_ids
    for form in (np.array(ids), np.array(ids, dtype=np.int32), [np.int64(t) for t in ids],
                 torch.tensor(ids), {"prompt_token_ids": np.array(ids)}):
        assert llm.generate(form, sp, use_tqdm=False)[0].outputs[0].token_ids == want
    both = llm.generate([np.array(ids), torch.tensor(ids)], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in both] == [want, want]
    # The engine's own entry point takes them too.
    llm.engine.check_request(np.array(ids), sp, None)


@pytest.mark.parametrize(("prompt", "message"), [
    ([5, 6.5, 7], r"prompt\[1\] must be an integer token id, got float 6.5"),
    ([5, True], r"prompt\[1\] must be an integer token id, got bool True"),
    ([[5, 6], [7, "x"]], r"prompts\[1\]\[1\] must be an integer token id, got str 'x'"),
    (np.array([1.0, 2.0]), "must hold integers, got a ndarray of float64"),
    (torch.tensor([[1, 2]]), "2-D Tensor is not a prompt"),
    ({"prompt_token_ids": [1, None]}, r"\['prompt_token_ids'\]\[1\] must be an integer token "
                                      "id, got NoneType"),
])
def test_bad_token_ids_name_the_element(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)


def test_chat_arguments(llm):
    tok = llm.get_tokenizer()

    def rendered(msgs, **kw):
        text = tok.apply_chat_template(msgs, tokenize=False, **kw)
        return tok.encode(text, add_special_tokens=False)

    msgs = [{"role": "user", "content": "the user asks"}]
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    out = llm.chat(msgs, sp, use_tqdm=False)[0]
    assert out.prompt_token_ids == rendered(msgs, add_generation_prompt=True)
    plain = llm.chat(msgs, sp, use_tqdm=False, add_generation_prompt=False)[0]
    assert plain.prompt_token_ids == rendered(msgs, add_generation_prompt=False)
    assert plain.prompt_token_ids != out.prompt_token_ids
    template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                "{% if shout %}yes{% endif %}")
    own = llm.chat(msgs, sp, use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"shout": True})[0]
    assert own.prompt_token_ids == tok.encode("the user asks yes", add_special_tokens=False)
    cont = llm.chat([*msgs, {"role": "assistant", "content": "the answer"}], sp,
                    use_tqdm=False, add_generation_prompt=False,
                    continue_final_message=True)[0]
    assert tok.decode(cont.prompt_token_ids).rstrip().endswith("the answer")
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "the user asks"}]}],
                     sp, use_tqdm=False)[0]
    assert parts.prompt_token_ids == out.prompt_token_ids
    with pytest.raises(ValueError, match="needs add_generation_prompt=False"):
        llm.chat(msgs, sp, use_tqdm=False, continue_final_message=True)


def test_logprobs_mode_raw_by_default_processed_on_request(assets):
    # At a temperature near 0 the processed distribution is one token at probability 1,
    # while the raw one is the model's.
    model_dir, _ = assets
    sp = SamplingParams(temperature=1e-3, max_tokens=3, logprobs=0, seed=1)
    raw = LLM(str(model_dir), device="cpu").generate([5, 6, 7], sp, use_tqdm=False)[0]
    processed = LLM(str(model_dir), device="cpu", logprobs_mode="processed_logprobs") \
        .generate([5, 6, 7], sp, use_tqdm=False)[0]
    assert raw.outputs[0].token_ids == processed.outputs[0].token_ids
    assert all(d[t].logprob == 0.0 for d, t in zip(processed.outputs[0].logprobs,
                                                    processed.outputs[0].token_ids,
                                                    strict=True))
    assert all(d[t].logprob < 0.0 for d, t in zip(raw.outputs[0].logprobs,
                                                   raw.outputs[0].token_ids, strict=True))
    assert raw.fingerprint != processed.fingerprint


def test_shutdown_and_context_manager(assets):
    model_dir, _ = assets
    with LLM(str(model_dir), device="cpu") as llm:
        assert llm.generate([5, 6], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.is_shut_down and not hasattr(llm.engine, "model")
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([5, 6], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.shutdown()  # again: nothing to do
