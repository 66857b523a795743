"""The rule the engine refuses tensor-parallel sizes by (``detlora.distributed.tp_sizes``)."""

import pytest

from detlora.distributed.tp_sizes import (
    Cut,
    TensorParallelDims,
    check_tensor_parallel,
    invariant_sizes,
)
from detlora.models.spec import ModelSpec


def test_each_cut_kind():
    assert Cut("h", 12, "heads").problem(8) and not Cut("h", 12, "heads").problem(4)
    kv = Cut("kv", 2, "kv_heads")
    assert [kv.problem(t) is None for t in (1, 2, 4, 8)] == [True] * 4  # split, then replicated
    assert Cut("kv", 3, "kv_heads").problem(2)  # neither
    assert "k_groups(100) = 4" in Cut("K", 100, "row_k").problem(8)
    assert Cut("K", 200, "row_k").problem(8) is None  # groups of 25: not whole blocks, fine


def test_from_config_reads_what_model_spec_reads():
    cfg = dict(architectures=["Qwen3ForCausalLM"], hidden_size=96, intermediate_size=200,
               num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2, head_dim=24,
               vocab_size=285, max_position_embeddings=64, rms_norm_eps=1e-6)
    spec = ModelSpec.from_config(cfg)
    assert TensorParallelDims.from_config(cfg) == TensorParallelDims.of(
        num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_sizes=(spec.intermediate_size,))
    no_head_dim = {k: v for k, v in cfg.items() if k != "head_dim"}
    assert TensorParallelDims.from_config(no_head_dim).cuts[2].value == 96  # 6 x 96 / 6


def test_hybrid_and_nested_configs():
    nemotron = dict(hidden_size=3136, intermediate_size=12544, num_attention_heads=40,
                    num_key_value_heads=8, attention_head_dim=128,
                    hybrid_override_pattern="M-M*", mamba_num_heads=96, mamba_head_dim=80,
                    n_groups=6)
    dims = TensorParallelDims.from_config(nemotron)
    assert {c.what for c in dims.cuts} >= {"mamba_num_heads", "n_groups",
                                           "num_attention_heads"}
    assert invariant_sizes(dims) == (1, 2)  # 6 groups
    mamba_only = TensorParallelDims.from_config({**nemotron, "hybrid_override_pattern": "MM"})
    assert "num_attention_heads" not in {c.what for c in mamba_only.cuts}
    gemma = {"text_config": dict(hidden_size=2560, intermediate_size=10240,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                                 global_head_dim=512, use_double_wide_mlp=True)}
    values = {c.value for c in TensorParallelDims.from_config(gemma).cuts}
    assert {4096, 20480} <= values  # full layers' o_proj K, double-wide MLP


def test_the_refusal_names_the_dimension_and_the_sizes_that_keep_the_bits():
    dims = TensorParallelDims.of(num_heads=14, num_kv_heads=2, head_dim=64,
                                 intermediate_sizes=(4864,))
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=4 cannot run this model with "
                       r"one device's bits: num_attention_heads=14 does not split evenly over "
                       r"4 ranks.*Sizes that keep them: 1, 2$"):
        check_tensor_parallel(dims, 4)
    check_tensor_parallel(dims, 2)
    with pytest.raises(ValueError, match="must be one of"):
        check_tensor_parallel(dims, 3)
