"""Batch-invariant mode: aten matmuls and row reductions run on detlora's kernels.

    with detlora.batch_invariant():
        logits = hf_model(input_ids).logits   # each row's bits independent of the batch

Inside the mode, torch's dispatcher sends these aten ops on CUDA tensors to detlora (through
``torch.library`` registrations for the CUDA dispatch key, removed again on exit):

    aten::mm            -> detlora.ops.matmul.matmul
    aten::addmm         -> detlora.ops.matmul.add_bias_mm       (beta = alpha = 1)
    aten::bmm           -> detlora.ops.matmul.bmm
    aten::_log_softmax  -> detlora.ops.softmax.log_softmax      (any dim: moved last)
    aten::mean.dim      -> detlora.ops.reductions.mean          (any dims: flattened last)

``nn.Linear``, ``F.linear``, ``torch.matmul`` and ``@`` decompose into mm/addmm/bmm, so they
are covered too. Everything the kernels do not cover runs the kernel that was registered
before the mode (normally ATen's), called through ``torch.library.get_kernel``: dtypes other
than bf16/fp16/fp32, mixed dtypes, empty tensors, 0-dim tensors, mismatched shapes (so ATen
raises its usual errors), addmm with beta or alpha other than 1, mean with a ``dtype`` other
than the input's or fp32, ``_log_softmax`` with ``half_to_float`` on fp32 input, and
log_softmax/mean while ``detlora.ops.softmax.log_softmax`` / ``detlora.ops.reductions.mean``
are not importable. Those fallbacks are correct but carry no batch-invariance promise. Calls
made from inside a routed op (by the kernels' own wrappers) also take the original kernel, so
a wrapper that falls back on torch cannot recurse into the mode.

fp32 matmuls use full fp32 products (as ``torch.mm`` does unless TF32 is allowed).

The mode is process-wide, as torch's dispatcher is: it affects every thread while on. It nests:
``batch_invariant()`` restores on exit (also on an exception) whatever state it found, so an
inner block's exit leaves an outer block's mode on. ``device_type="cpu"`` routes CPU tensors
instead; it exists for tests under Triton's interpreter (``TRITON_INTERPRET=1``) and falls back
to ATen when the interpreter is off.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from detlora.ops._runtime import kernels_available_for

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROUTED_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_log_softmax", "aten::mean.dim")
_DISPATCH_KEYS = {"cuda": "CUDA", "cpu": "CPU"}


@dataclass(frozen=True)
class _Mode:
    device_type: str
    library: torch.library.Library


_lock = threading.RLock()
_mode: _Mode | None = None
_routing = threading.local()  # .active: this thread is inside a routed op


def is_batch_invariant_mode_enabled() -> bool:
    return _mode is not None


def enable_batch_invariant_mode(device_type: str = "cuda") -> None:
    """Route the ops listed in the module docstring to detlora (no-op if already on)."""
    global _mode
    key = _dispatch_key(device_type)
    with _lock:
        if _mode is not None:
            if _mode.device_type != device_type:
                raise ValueError(
                    f"batch-invariant mode is already on for device_type={_mode.device_type!r};"
                    f" cannot also turn it on for {device_type!r}")
            return
        originals = {op: torch.library.get_kernel(op, key) for op in ROUTED_OPS}
        library = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                # torch warns once that a registered kernel is being overridden: that is the
                # point of the mode.
                warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
                for op, impl in _impls(originals).items():
                    library.impl(op, impl, key, with_keyset=True)
        except BaseException:
            library._destroy()
            raise
        _mode = _Mode(device_type, library)


def disable_batch_invariant_mode() -> None:
    """Remove the registrations; the ops run their previous kernels again (no-op if off)."""
    global _mode
    with _lock:
        if _mode is None:
            return
        # Library has no public way to drop its registrations; _destroy() is what deregisters.
        _mode.library._destroy()
        _mode = None


@contextlib.contextmanager
def batch_invariant(enabled: bool = True, device_type: str = "cuda") -> Iterator[None]:
    """Turn the mode on (or off, with ``enabled=False``) for a block; restore the old state."""
    with _lock:
        previous = _mode.device_type if _mode is not None else None
        _set(enabled, device_type)
    try:
        yield
    finally:
        with _lock:
            if previous is None:
                disable_batch_invariant_mode()
            elif _mode is None or _mode.device_type != previous:
                disable_batch_invariant_mode()
                enable_batch_invariant_mode(previous)


def _set(enabled: bool, device_type: str) -> None:
    if enabled:
        enable_batch_invariant_mode(device_type)
    else:
        _dispatch_key(device_type)
        disable_batch_invariant_mode()


def _dispatch_key(device_type: str) -> str:
    if device_type not in _DISPATCH_KEYS:
        raise ValueError(
            f"device_type must be one of {sorted(_DISPATCH_KEYS)}, got {device_type!r}")
    return _DISPATCH_KEYS[device_type]


# ----------------------------------------------------------------------------- overrides


@contextlib.contextmanager
def _routed() -> Iterator[None]:
    _routing.active = True
    try:
        yield
    finally:
        _routing.active = False


def _kernel_dtype(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return dtype in _DTYPES and all(
        t.dtype == dtype and t.numel() > 0 and kernels_available_for(t) for t in tensors)


def _impls(orig: dict[str, Callable]) -> dict[str, Callable]:
    """One override per routed op; each takes the dispatch keyset first (``with_keyset``)."""

    def fallback(op: str, keyset, *args, **kwargs):
        return orig[op].call_boxed(keyset, *args, **kwargs)

    def mm(keyset, a, b):
        if (not getattr(_routing, "active", False) and a.dim() == 2 and b.dim() == 2
                and a.shape[1] == b.shape[0] and _kernel_dtype(a, b)):
            from detlora.ops.matmul import matmul

            with _routed():
                return matmul(a, b)
        return fallback("aten::mm", keyset, a, b)

    def addmm(keyset, bias, a, b, *, beta=1, alpha=1):
        if (not getattr(_routing, "active", False) and beta == 1 and alpha == 1
                and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
                and bias.dim() <= 2 and _broadcasts(bias.shape, (a.shape[0], b.shape[1]))
                and _kernel_dtype(a, b, bias)):
            from detlora.ops.matmul import add_bias_mm

            with _routed():
                return add_bias_mm(bias, a, b)
        return fallback("aten::addmm", keyset, bias, a, b, beta=beta, alpha=alpha)

    def bmm(keyset, a, b):
        if (not getattr(_routing, "active", False) and a.dim() == 3 and b.dim() == 3
                and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]
                and _kernel_dtype(a, b)):
            from detlora.ops.matmul import bmm as detlora_bmm

            with _routed():
                return detlora_bmm(a, b)
        return fallback("aten::bmm", keyset, a, b)

    def log_softmax(keyset, x, dim, half_to_float):
        if (not getattr(_routing, "active", False) and x.dim() >= 1 and _kernel_dtype(x)
                and not (half_to_float and x.dtype == torch.float32)):
            kernel = _optional("detlora.ops.softmax", "log_softmax")
            if kernel is not None:
                with _routed():
                    return _log_softmax_any_dim(kernel, x.float() if half_to_float else x, dim)
        return fallback("aten::_log_softmax", keyset, x, dim, half_to_float)

    def mean(keyset, x, dim, keepdim=False, *, dtype=None):
        if (not getattr(_routing, "active", False) and x.dim() >= 1 and _kernel_dtype(x)
                and dtype in (None, x.dtype, torch.float32)
                and _distinct_dims(dim, x.dim())):
            kernel = _optional("detlora.ops.reductions", "mean")
            if kernel is not None:
                with _routed():
                    return _mean_any_dims(kernel, x if dtype is None else x.to(dtype), dim,
                                          keepdim)
        return fallback("aten::mean.dim", keyset, x, dim, keepdim, dtype=dtype)

    return {"aten::mm": mm, "aten::addmm": addmm, "aten::bmm": bmm,
            "aten::_log_softmax": log_softmax, "aten::mean.dim": mean}


def _optional(module: str, name: str) -> Callable | None:
    """A kernel wrapper, or None while it does not exist (fall back to ATen then)."""
    try:
        mod = __import__(module, fromlist=[name])
    except ImportError:
        return None
    return getattr(mod, name, None)


def _broadcasts(shape: torch.Size, target: tuple[int, int]) -> bool:
    shape = tuple(shape)
    padded = (1,) * (2 - len(shape)) + shape
    return all(s in (1, t) for s, t in zip(padded, target, strict=True))


def _distinct_dims(dim, ndim: int) -> bool:
    if not dim:
        return True
    wrapped = [d % ndim if -ndim <= d < ndim else None for d in dim]
    return None not in wrapped and len(set(wrapped)) == len(wrapped)


def _log_softmax_any_dim(kernel: Callable, x: torch.Tensor, dim: int) -> torch.Tensor:
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1]).contiguous()
    y = kernel(rows).reshape(moved.shape).movedim(-1, dim)
    return y.contiguous()


def _mean_any_dims(kernel: Callable, x: torch.Tensor, dim, keepdim: bool) -> torch.Tensor:
    ndim = x.dim()
    reduced = sorted({d % ndim for d in dim}) if dim else list(range(ndim))
    kept = [d for d in range(ndim) if d not in reduced]
    kept_shape = [x.shape[d] for d in kept]
    cols = 1
    for d in reduced:
        cols *= x.shape[d]
    rows = x.permute(*kept, *reduced).reshape(-1, cols).contiguous()
    y = kernel(rows).reshape(kept_shape)
    if keepdim:
        for d in reduced:
            y = y.unsqueeze(d)
    return y


__all__ = [
    "ROUTED_OPS", "batch_invariant", "disable_batch_invariant_mode",
    "enable_batch_invariant_mode", "is_batch_invariant_mode_enabled",
]
