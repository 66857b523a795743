import pytest

from detlora.config import Determinism, LoRAReduction, SamplingParams
from detlora.engine_args import EngineArgs


def test_sampling_defaults():
    p = SamplingParams(temperature=0.0)
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (16, 0.0, -1, 1.0, None)
    assert p.greedy and p.stop_token_ids == ()
    assert SamplingParams(temperature=0.0, stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"stop_token_ids": [1, -3]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_args_resolve_and_validates():
    c = EngineArgs(model="m")
    assert c.resolved_determinism is Determinism.BATCH_INVARIANT
    assert c.resolved_lora_reduction is LoRAReduction.IN_GEMM
    c = EngineArgs(model="m", determinism="fast", lora_reduction="ordered")
    assert c.determinism is Determinism.FAST and c.resolved_lora_reduction is LoRAReduction.ORDERED
    for kwargs, field in [({"block_size": 12}, "block_size"), ({"max_num_seqs": 0}, "max_num_seqs"),
                          ({"dtype": "int8"}, "dtype"), ({"device": "tpu"}, "device"),
                          ({"device": "cuda:x"}, "cuda:N"), ({"device": "cuda:"}, "cuda:N"),
                          ({"determinism": "exact"}, "determinism"),
                          ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
                          ({"max_loras": 0}, "max_loras")]:
        with pytest.raises(ValueError, match=field):
            EngineArgs(model="m", **kwargs)
