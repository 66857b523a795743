"""Which implementation of every op a model runs, chosen once per engine.

Layers never pick kernels themselves: they call ``backend.<op>(...)`` with the arguments of
the op's torch reference (``detlora.ops.<op>.<op>_ref``). ``make_backend`` binds each op for a
device and determinism level:

* CPU: every op is its torch reference, so the engine runs anywhere (fp32 or bf16). The
  references add no nondeterminism of their own, but whole-batch BLAS calls are not
  batch-invariant, so ``batch_invariant`` swaps in ``detlora.ops.cpu_invariant`` for the
  linear, the LoRA shrink and expand and attention (fixed-shape tiles).
* CUDA: ``fast`` = cuBLAS linear + atomic LoRA shrink + split-KV attention + the detlora
  row-wise kernels; ``run_to_run`` = the same with the LoRA shrink inside the cuBLAS GEMM
  (``in_gemm``); ``batch_invariant`` = the split-invariant detlora linear (the shrink inside
  it, ``in_gemm``) + detlora paged attention, RMSNorm,
  log-softmax and argmax. Gathers and elementwise ops (embedding, rotary, silu_and_mul,
  write_kv) are batch-invariant by construction, so their torch references serve when no
  kernel exists. If a kernel a level needs is missing, ``make_backend`` refuses rather than
  break the promise silently (``allow_reference_fallback=True`` takes the reference anyway
  and records it in ``impls``, for debugging numerics).

Kernels are imported here, lazily, only for CUDA: importing this module loads no Triton code.
"""

from __future__ import annotations

import functools
import importlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from detlora.config import DEFAULT_DETERMINISM, DEFAULT_LORA_REDUCTION, Determinism, LoRAReduction
from detlora.ops import grouped_linear
from detlora.ops._runtime import interpreting


@dataclass(frozen=True)
class OpBackend:
    """The ops of one engine, bound to implementations. Every field from ``embedding`` to
    ``lora_expand`` is a callable with the signature of the op's torch reference (see
    ``detlora.ops``)."""

    embedding: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # (x, weight, bias, *, slot_columns=None): slot_columns (ops.matmul.SlotColumns) lets the
    # batch-invariant kernel skip the in_gemm columns of slots no row uses.
    linear: Callable[..., torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (qkv, q_weight, k_weight, eps, heads, kv_heads, head_dim) -> qkv, q/k heads normalized
    qk_rms_norm: Callable[..., torch.Tensor]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    log_softmax: Callable[[torch.Tensor], torch.Tensor]
    argmax: Callable[[torch.Tensor], torch.Tensor]
    # (x, lora_a, groups, scale) -> fp32 [S, M, R]; the reduction and workspace are bound.
    lora_shrink: Callable[..., torch.Tensor]  # (x, lora_a, groups, scale, out=None)
    # (y, shrink_out, lora_b, groups, slice_offsets, slot_ranks=None) -> y, updated in place;
    # slot_ranks (LoRASlots.lora_rank) lets a kernel skip the ranks past each slot's own.
    lora_expand: Callable[..., torch.Tensor]
    # Linears of tensor-parallel layers (detlora.ops.grouped_linear; layers/parallel_linear.py),
    # both with ``linear``'s optional slot_columns:
    # (x, weight, bias, full_n) -> x W^T + b, each output reduced over K as in the layer of
    # ``full_n`` (base) outputs that W is a column shard of (its bits, whatever the shard's
    # width);
    column_linear: Callable[..., torch.Tensor]
    # (x, weight, bias, groups) -> x W^T + b with K summed as ``groups`` ordered group partials
    # at batch_invariant (the tree every tensor-parallel size reproduces), else ``linear``;
    row_linear: Callable[..., torch.Tensor]
    # (x, weight, groups) -> fp32 [groups, M, N], each group's partial from zero;
    linear_partials: Callable[..., torch.Tensor]
    # (partials [G, M, N] fp32, bias, dtype) -> their sum in group order plus bias, rounded.
    sum_partials: Callable[..., torch.Tensor]
    device: torch.device
    determinism: Determinism
    lora_reduction: LoRAReduction
    impls: Mapping[str, str] = field(default_factory=dict)  # op -> implementation, for fingerprints
    # (q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping) -> rotated q, with k
    # rotated and v written into the pages: rotary + write_kv in one kernel, their bits;
    # None: the two ops one after the other.
    rotary_write_kv: Callable[..., torch.Tensor] | None = None
    # (y, shrink_out, lora_b, groups, slice_offsets, positions, cos_sin, k_cache, v_cache,
    # slot_mapping, *, slot_ranks=None) -> rotated q: the q|k|v LoRA expand fused into
    # rotary_write_kv, the unfused bits; None: the expand, then rotate_and_write_kv.
    lora_expand_rotary_write_kv: Callable[..., torch.Tensor] | None = None
    # (y, shrink_out, lora_b, groups, *, slot_ranks=None) -> silu_and_mul(y + the LoRA update)
    # in one kernel, with the unfused ops' bits; None: the two ops one after the other.
    lora_expand_silu_and_mul: Callable[..., torch.Tensor] | None = None
    # (x [T, V], index [T], out=None) -> log_softmax(x.float())[t, index[t]], fp32 [T]: the
    # log_softmax op's bits for one column per row; None: the sampler gathers it from a
    # full log_softmax.
    chosen_logprob: Callable[..., torch.Tensor] | None = None
    # The sampler's Gumbel-max and top-k/top-p filters: Triton kernels (True) or their torch
    # references; both give the same tokens.
    sampling_kernels: bool = False
    # Gemma's elementwise ops (ops/gelu_and_mul.py, ops/softcap.py): (x [T, 2I]) -> GeGLU;
    # (g, u) -> gelu_tanh(g) * u; (logits, cap) -> cap * tanh(logits / cap). Bound with the
    # others by make_backend; None only in an OpBackend built by hand.
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    gelu_tanh_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    softcap: Callable[[torch.Tensor, float], torch.Tensor] | None = None
    # State-space (Mamba-2) layers and Nemotron-H's MLP, with their references' signatures:
    # causal_conv1d (ops/mamba_conv.py), mamba_chunk_scan (ops/mamba_ssd.py), gated_rms_norm
    # (ops/gated_rms_norm.py), relu_squared (ops/relu_squared.py).
    causal_conv1d: Callable[..., torch.Tensor] | None = None
    mamba_chunk_scan: Callable[..., torch.Tensor] | None = None
    gated_rms_norm: Callable[..., torch.Tensor] | None = None
    relu_squared: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def lora_in_gemm(self) -> bool:
        """True when every adapter slot's A rides as extra output columns of the base
        weight, so linear layers reserve room for them."""
        return self.lora_reduction is LoRAReduction.IN_GEMM

    @property
    def exact_reductions(self) -> bool:
        """True when a reduction across tensor-parallel ranks must give one device's bits
        (batch_invariant): ranks gather fp32 partials and add them in a fixed order, never
        through a collective's own arithmetic."""
        return self.determinism is Determinism.BATCH_INVARIANT

    @property
    def name(self) -> str:
        return f"{self.device.type}-{self.determinism.value}-{self.lora_reduction.value}"

    def expand_silu_and_mul(
        self, y: torch.Tensor, shrink_out: Any, lora_b: torch.Tensor, groups: Any,
        *, slot_ranks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """SwiGLU of a gate|up output ``y`` plus its LoRA update (``y`` may be overwritten)."""
        if self.lora_expand_silu_and_mul is not None:
            return self.lora_expand_silu_and_mul(y, shrink_out, lora_b, groups,
                                                 slot_ranks=slot_ranks)
        return self.silu_and_mul(self.lora_expand(y, shrink_out, lora_b, groups, None,
                                                  slot_ranks=slot_ranks))

    def act_and_mul(self, activation: str, y: torch.Tensor) -> torch.Tensor:
        """The gated activation ``activation`` ("silu" or "gelu_tanh") of gate|up ``y``."""
        if activation == "silu":
            return self.silu_and_mul(y)
        assert activation == "gelu_tanh" and self.gelu_tanh_and_mul is not None
        return self.gelu_tanh_and_mul(y)

    def expand_act_and_mul(
        self, activation: str, y: torch.Tensor, shrink_out: Any, lora_b: torch.Tensor,
        groups: Any, *, slot_ranks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``act_and_mul`` of gate|up ``y`` plus its LoRA update (``y`` may be overwritten):
        SiLU fused into the expand where the kernel exists, else the expand then the op."""
        if activation == "silu":
            return self.expand_silu_and_mul(y, shrink_out, lora_b, groups,
                                            slot_ranks=slot_ranks)
        y = self.lora_expand(y, shrink_out, lora_b, groups, None, slot_ranks=slot_ranks)
        return self.act_and_mul(activation, y)

    def rotate_and_write_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
        cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Rotary of q and k, then k and v into their page slots; the rotated q."""
        if self.rotary_write_kv is not None:
            return self.rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache,
                                        slot_mapping)
        q, k = self.rotary(q, k, positions, cos_sin)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def expand_rotate_and_write_kv(
        self, y: torch.Tensor, shrink_out: Any, lora_b: torch.Tensor, groups: Any,
        slice_offsets: Sequence[int], positions: torch.Tensor, cos_sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
        *, slot_ranks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rotate_and_write_kv`` of a q|k|v output ``y`` plus its LoRA update (three
        slices); the rotated q. ``y`` may be overwritten."""
        if self.lora_expand_rotary_write_kv is not None:
            return self.lora_expand_rotary_write_kv(y, shrink_out, lora_b, groups,
                                                    slice_offsets, positions, cos_sin,
                                                    k_cache, v_cache, slot_mapping,
                                                    slot_ranks=slot_ranks)
        y = self.lora_expand(y, shrink_out, lora_b, groups, slice_offsets,
                             slot_ranks=slot_ranks)
        m, d = y.shape[0], k_cache.shape[3]
        q, k, v = (y[:, lo:hi].view(m, (hi - lo) // d, d)
                   for lo, hi in itertools.pairwise(slice_offsets))
        return self.rotate_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache,
                                        slot_mapping)

    def describe(self) -> dict[str, str]:
        """What decides the bits of this backend: level, LoRA reduction, one entry per op."""
        return {
            "device": self.device.type,
            "determinism": self.determinism.value,
            "lora_reduction": self.lora_reduction.value,
            **{f"op.{k}": v for k, v in sorted(self.impls.items())},
        }


# op -> (module under detlora.ops, reference function, kernel function).
_OPS: dict[str, tuple[str, str, str]] = {
    "embedding": ("embedding", "embedding_ref", "embedding"),
    "linear": ("matmul", "linear_ref", "linear"),
    "rms_norm": ("rms_norm", "rms_norm_ref", "rms_norm"),
    "fused_add_rms_norm": ("rms_norm", "fused_add_rms_norm_ref", "fused_add_rms_norm"),
    "qk_rms_norm": ("qk_norm", "qk_rms_norm_ref", "qk_rms_norm"),
    "rotary": ("rotary", "rotary_ref", "rotary"),
    "silu_and_mul": ("silu_and_mul", "silu_and_mul_ref", "silu_and_mul"),
    "write_kv": ("paged_attention", "write_kv_ref", "write_kv"),
    "paged_attention": ("paged_attention", "paged_attention_ref", "paged_attention"),
    "log_softmax": ("softmax", "log_softmax_ref", "log_softmax"),
    "argmax": ("reductions", "argmax_ref", "argmax"),
    "chosen_logprob": ("softmax", "chosen_logprob_ref", "chosen_logprob"),
    "gelu_tanh_and_mul": ("gelu_and_mul", "gelu_tanh_and_mul_ref", "gelu_tanh_and_mul"),
    "gelu_tanh_mul": ("gelu_and_mul", "gelu_tanh_mul_ref", "gelu_tanh_mul"),
    "softcap": ("softcap", "softcap_ref", "softcap"),
    "causal_conv1d": ("mamba_conv", "causal_conv1d_ref", "causal_conv1d"),
    "mamba_chunk_scan": ("mamba_ssd", "mamba_chunk_scan_ref", "mamba_chunk_scan"),
    "gated_rms_norm": ("gated_rms_norm", "gated_rms_norm_ref", "gated_rms_norm"),
    "relu_squared": ("relu_squared", "relu_squared_ref", "relu_squared"),
}

# How each CUDA level implements each op:
#   "kernel":   the detlora Triton kernel, required (missing = refused unless fallback allowed);
#   "any":      the kernel when it exists, else the torch reference;
#   "vendor":   cuBLAS through torch (linear);
#   "split_kv": FlashDecoding-style split-KV attention (ops/paged_attention_split_kv.py),
#               whose split points move with the batch: fast, repeatable for a fixed batch.
_POLICY: dict[Determinism, dict[str, str]] = {
    Determinism.FAST: {**dict.fromkeys(_OPS, "any"), "linear": "vendor",
                       "paged_attention": "split_kv"},
    # cuBLAS and split-KV are repeatable for a fixed batch; the LoRA shrink is deterministic
    # (in_gemm by default).
    Determinism.RUN_TO_RUN: {**dict.fromkeys(_OPS, "any"), "linear": "vendor",
                             "paged_attention": "split_kv"},
    # Gathers and elementwise ops are batch-invariant even as torch references; every op
    # with a reduction must be a detlora kernel.
    Determinism.BATCH_INVARIANT: {
        **dict.fromkeys(_OPS, "kernel"),
        **dict.fromkeys(("embedding", "rotary", "silu_and_mul", "write_kv", "gelu_tanh_and_mul",
                         "gelu_tanh_mul", "softcap", "relu_squared"), "any"),
    },
}
# Kernels whose range checks sync the host: the engine guarantees ids < vocab and positions
# < the rotary table, and a sync would break CUDA-graph capture.
_NO_HOST_CHECKS = {"embedding": {"validate": False}, "rotary": {"validate": False}}


def make_backend(
    device: torch.device | str = "cpu",
    determinism: Determinism | str | None = None,
    lora_reduction: LoRAReduction | str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_lora_rank: int | None = None,
    kernels: bool | None = None,
    allow_reference_fallback: bool = False,
) -> OpBackend:
    """Bind every op for ``device`` and ``determinism`` (default: ``DEFAULT_DETERMINISM``).
    ``lora_reduction`` overrides the level's LoRA shrink reduction.
    ``dtype`` is the model dtype; the kernels take bf16/fp16 only. ``kernels`` (default: on
    CUDA only) binds the Triton kernels; on the CPU that needs ``TRITON_INTERPRET=1``, which
    runs the CUDA path in Triton's interpreter (tests), and False on CUDA runs the torch
    references there (debugging)."""
    device = torch.device(device)
    level = DEFAULT_DETERMINISM if determinism is None else Determinism.parse(determinism)
    reduction = (
        DEFAULT_LORA_REDUCTION[level]
        if lora_reduction is None
        else LoRAReduction.parse(lora_reduction)
    )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    use_kernels = device.type == "cuda" if kernels is None else kernels
    if not use_kernels:
        return _reference_backend(device, level, reduction)
    if device.type == "cpu" and not interpreting():
        raise ValueError("kernels=True on the CPU needs TRITON_INTERPRET=1, set before any "
                         "detlora.ops kernel module is imported")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not supported by the kernels: they take bfloat16 "
                         "or float16 (run float32 with kernels=False)")
    return _kernel_backend(device, level, reduction, max_lora_rank, allow_reference_fallback)


def _module(name: str) -> Any:
    return importlib.import_module(f"detlora.ops.{name}")


def _reference_backend(
    device: torch.device, level: Determinism, reduction: LoRAReduction
) -> OpBackend:
    from detlora.ops.lora_expand import lora_expand_ref
    from detlora.ops.lora_shrink import lora_shrink_ref

    ops = {op: getattr(_module(mod), ref) for op, (mod, ref, _) in _OPS.items()}

    def shrink(x, lora_a, groups, scale, out=None):
        h = lora_shrink_ref(x, lora_a, groups.token_adapter, scale)
        return h if out is None else out.copy_(h)

    def expand(y, shrink_out, lora_b, groups, slice_offsets=None, slot_ranks=None):
        # Every rank summed: past a slot's rank h and B are zero, so no value changes (and
        # the whole-rank products keep the bits these references always had).
        return lora_expand_ref(y, shrink_out, lora_b, groups.token_adapter, slice_offsets)

    impls = {op: f"{mod}.{ref}" for op, (mod, ref, _) in _OPS.items()}
    impls |= {"lora_shrink": "lora_shrink.lora_shrink_ref",
              "lora_expand": "lora_expand.lora_expand_ref"}
    ops |= {"lora_shrink": shrink, "lora_expand": expand}
    if level is Determinism.BATCH_INVARIANT and device.type == "cpu":
        # Whole-batch BLAS calls change a row's bits with the batch: fixed-shape tiles instead.
        from detlora.ops import cpu_invariant

        for op in _CPU_INVARIANT_OPS:
            ops[op] = getattr(cpu_invariant, op)
            impls[op] = f"cpu_invariant.{op}"
    impls["lora_shrink"] = _shrink_impl(reduction, impls, impls["lora_shrink"])
    linear = ops["linear"]
    ops["column_linear"] = lambda x, weight, bias, full_n, slot_columns=None: linear(
        x, weight, bias, slot_columns=slot_columns)
    impls["column_linear"] = impls["linear"]
    if level is Determinism.BATCH_INVARIANT and device.type == "cpu":
        from detlora.ops import cpu_invariant

        ops["row_linear"] = cpu_invariant.linear_grouped
        ops["linear_partials"] = cpu_invariant.linear_partials
        impls["row_linear"] = "cpu_invariant.linear_grouped"
    else:
        ops["row_linear"] = lambda x, weight, bias, groups, slot_columns=None: linear(
            x, weight, bias, slot_columns=slot_columns)
        ops["linear_partials"] = grouped_linear.linear_partials_ref
        impls["row_linear"] = impls["linear"]
    ops["sum_partials"] = grouped_linear.sum_partials
    return OpBackend(**ops, device=device, determinism=level, lora_reduction=reduction,
                     impls=MappingProxyType(impls))


# Ops whose torch references reduce in whole-batch BLAS calls, or (SiLU) give an element
# bits that depend on its place in the row (see ``detlora.ops.cpu_invariant``).
_CPU_INVARIANT_OPS = ("linear", "paged_attention", "lora_shrink", "lora_expand", "silu_and_mul")


def _shrink_impl(reduction: LoRAReduction, impls: Mapping[str, str], kernel: str) -> str:
    """What computes the shrink: its kernel, or for in_gemm the level's linear."""
    return f"in_gemm:{impls['linear']}" if reduction is LoRAReduction.IN_GEMM else kernel


def _vendor_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    *, slot_columns: object = None,
) -> torch.Tensor:
    del slot_columns  # cuBLAS computes every column
    return torch.nn.functional.linear(x, weight, bias)


def _kernel(module: str, name: str) -> Callable[..., Any] | None:
    try:
        return getattr(_module(module), name, None)
    except ModuleNotFoundError:
        return None


def _bind_cuda(
    op: str, policy: str, allow_reference_fallback: bool
) -> tuple[Callable[..., Any], str] | None:
    """(implementation, its name) of ``op`` under ``policy``; None if a required kernel is
    missing."""
    mod_name, ref, kernel = _OPS[op]
    if policy == "vendor":
        return _vendor_linear, "torch.nn.functional.linear"
    candidates = [(mod_name, kernel)]
    if policy == "split_kv":  # else the detlora kernel: slower, but repeatable too
        candidates.insert(0, ("paged_attention_split_kv", "paged_attention_split_kv"))
    for module, name in candidates:
        fn = _kernel(module, name)
        if fn is not None:
            if op in _NO_HOST_CHECKS:
                fn = functools.partial(fn, **_NO_HOST_CHECKS[op])
            return fn, f"{module}.{name}"
    if policy != "kernel" or allow_reference_fallback:
        return getattr(_module(mod_name), ref), f"{mod_name}.{ref}"
    return None


def _kernel_backend(
    device: torch.device,
    level: Determinism,
    reduction: LoRAReduction,
    max_lora_rank: int | None,
    allow_reference_fallback: bool,
) -> OpBackend:
    from detlora.ops.lora_expand import lora_expand
    from detlora.ops.lora_expand_rotary_write_kv import lora_expand_rotary_write_kv
    from detlora.ops.lora_expand_silu_and_mul import lora_expand_silu_and_mul
    from detlora.ops.lora_shrink import lora_shrink
    from detlora.ops.lora_workspace import MAX_LORA_RANK, LoRAWorkspace
    from detlora.ops.rotary_write_kv import rotary_write_kv

    ops: dict[str, Callable[..., Any]] = {}
    impls: dict[str, str] = {}
    missing: list[str] = []
    for op in _OPS:
        bound = _bind_cuda(op, _POLICY[level][op], allow_reference_fallback)
        if bound is None:
            missing.append(f"detlora.ops.{_OPS[op][0]}.{_OPS[op][2]}")
        else:
            ops[op], impls[op] = bound
    if missing:
        raise ValueError(
            f"determinism={level.value!r} needs Triton kernels that are not available: "
            f"{', '.join(missing)} (allow_reference_fallback=True runs the torch references, "
            "without the batch-invariance promise)"
        )

    # One workspace per engine: scratch and counters allocated once, CUDA-graph safe.
    workspace = LoRAWorkspace(device, max_lora_rank or MAX_LORA_RANK)

    def shrink(x, lora_a, groups, scale, out=None):
        return lora_shrink(x, lora_a, groups, scale, reduction=reduction, out=out,
                           workspace=workspace)

    def expand(y, shrink_out, lora_b, groups, slice_offsets: Sequence[int] | None = None,
               slot_ranks=None):
        return lora_expand(y, shrink_out, lora_b, groups, slice_offsets, slot_ranks=slot_ranks)

    impls |= {"lora_shrink": _shrink_impl(reduction, impls,
                                          f"lora_shrink.lora_shrink[{reduction.value}]"),
              "lora_expand": "lora_expand.lora_expand",
              "lora_expand_silu_and_mul": "lora_expand_silu_and_mul.lora_expand_silu_and_mul",
              "rotary_write_kv": "rotary_write_kv.rotary_write_kv",
              "lora_expand_rotary_write_kv":
                  "lora_expand_rotary_write_kv.lora_expand_rotary_write_kv"}
    linear_op = ops["linear"]
    if level is Determinism.BATCH_INVARIANT and impls["linear"] == "matmul.linear":
        from detlora.ops.matmul import k_split
        from detlora.ops.matmul import linear as bi_linear

        def column_linear(x, weight, bias, full_n, slot_columns=None):
            return bi_linear(x, weight, bias, slot_columns=slot_columns,
                             split=k_split(full_n, weight.shape[1], weight.dtype))

        ops |= {"column_linear": column_linear, "row_linear": grouped_linear.linear_grouped,
                "linear_partials": grouped_linear.linear_partials}
        impls |= {"column_linear": "matmul.linear[k_split of the full layer]",
                  "row_linear": "grouped_linear.linear_grouped"}
    else:
        ops |= {"column_linear": lambda x, weight, bias, full_n, slot_columns=None: linear_op(
                    x, weight, bias, slot_columns=slot_columns),
                "row_linear": lambda x, weight, bias, groups, slot_columns=None: linear_op(
                    x, weight, bias, slot_columns=slot_columns),
                "linear_partials": grouped_linear.linear_partials_ref}
        impls |= {"column_linear": impls["linear"], "row_linear": impls["linear"]}
    ops["sum_partials"] = grouped_linear.sum_partials
    return OpBackend(**ops, lora_shrink=shrink, lora_expand=expand, device=device,
                     determinism=level, lora_reduction=reduction,
                     impls=MappingProxyType(impls), sampling_kernels=device.type == "cuda",
                     lora_expand_silu_and_mul=lora_expand_silu_and_mul,
                     # The engine checks positions once per step; a sync breaks graph capture.
                     rotary_write_kv=functools.partial(rotary_write_kv, validate=False),
                     lora_expand_rotary_write_kv=functools.partial(
                         lora_expand_rotary_write_kv, validate=False))
