"""make_backend: level defaults and refusals that need no GPU."""

from __future__ import annotations

import pytest
import torch

from detlora.config import Determinism, LoRAReduction
from detlora.layers.backend import make_backend
from detlora.ops.rms_norm import rms_norm_ref

OPS = ("embedding", "linear", "rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul",
       "write_kv", "paged_attention", "log_softmax", "argmax", "lora_shrink", "lora_expand")


def test_cpu_backend_runs_the_references():
    b = make_backend("cpu", "run_to_run", lora_reduction="ordered")
    assert b.lora_reduction is LoRAReduction.ORDERED
    assert b.rms_norm is rms_norm_ref
    assert not b.sampling_kernels and not b.lora_in_gemm
    desc = b.describe()
    assert {f"op.{op}" for op in OPS} <= set(desc)
    assert all(v.endswith("_ref") for k, v in desc.items() if k.startswith("op."))


def test_one_default_level_and_the_cpu_invariant_ops_come_from_the_policy():
    """The default level is batch_invariant on every device; on the CPU it binds the
    fixed-tile GEMMs and attention of ops.cpu_invariant, and the references elsewhere."""
    from detlora.ops import cpu_invariant

    b = make_backend("cpu")
    assert b.determinism is Determinism.BATCH_INVARIANT
    assert b.lora_reduction is LoRAReduction.IN_GEMM and b.lora_in_gemm
    assert b.linear is cpu_invariant.linear
    assert b.paged_attention is cpu_invariant.paged_attention
    assert b.rms_norm is rms_norm_ref
    desc = b.describe()
    assert desc["op.linear"] == "cpu_invariant.linear"
    assert desc["op.lora_shrink"] == "in_gemm:cpu_invariant.linear"
    assert desc["op.rms_norm"].endswith("_ref")


def test_level_picks_the_lora_reduction_unless_overridden():
    assert make_backend("cpu", "batch_invariant").lora_reduction is LoRAReduction.IN_GEMM
    assert make_backend("cpu", "run_to_run").lora_reduction is LoRAReduction.IN_GEMM
    assert make_backend("cpu", "fast").lora_reduction is LoRAReduction.ATOMIC
    b = make_backend("cpu", "fast", lora_reduction="tree")
    assert b.lora_reduction is LoRAReduction.TREE
    assert b.describe()["lora_reduction"] == "tree"


@pytest.mark.parametrize("kwargs,match", [
    (dict(determinism="exact"), "determinism must be one of"),
    (dict(lora_reduction="sorted"), "reduction must be one of"),
    (dict(device="mps"), "device must be 'cpu' or 'cuda'"),
    (dict(device="cuda", dtype=torch.float32), "they take bfloat16 or float16"),
    (dict(kernels=True, dtype=torch.float32), "they take bfloat16 or float16"),
])
def test_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_backend(**kwargs)


def test_cpu_kernels_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_backend("cpu", kernels=True, dtype=torch.float16)


def test_kernel_backend_binds_every_op_to_a_kernel():
    """The bindings a GPU gets, checked here through the interpreter: no reference left,
    split-KV attention for fast/run_to_run, the invariant kernels for batch_invariant."""
    from detlora.ops._runtime import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    impls = {lvl: make_backend("cpu", lvl, dtype=torch.float16, kernels=True).impls
             for lvl in ("fast", "run_to_run", "batch_invariant")}
    for lvl, got in impls.items():
        assert not [op for op, v in got.items() if v.endswith("_ref")], lvl
    assert impls["fast"]["linear"] == impls["run_to_run"]["linear"] == \
        "torch.nn.functional.linear"
    assert impls["fast"]["paged_attention"].startswith("paged_attention_split_kv.")
    assert impls["batch_invariant"]["linear"] == "matmul.linear"
    assert impls["batch_invariant"]["paged_attention"] == "paged_attention.paged_attention"
    assert impls["fast"]["lora_shrink"].endswith("[atomic]")
    # The deterministic levels compute the shrink in their own linear (in_gemm).
    assert impls["run_to_run"]["lora_shrink"] == "in_gemm:torch.nn.functional.linear"
    assert impls["batch_invariant"]["lora_shrink"] == "in_gemm:matmul.linear"
    ordered = make_backend("cpu", "run_to_run", "ordered", dtype=torch.float16, kernels=True)
    assert ordered.impls["lora_shrink"].endswith("[ordered]")
