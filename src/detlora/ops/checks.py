"""Argument checks shared by the op wrappers.

Every failure is a ValueError that names the argument and says what was expected, so a bad
call fails loudly before a kernel reads out of bounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detlora.ops._runtime import interpreting


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    unit_last_stride: bool = False,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if unit_last_stride and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride 1), got strides {t.stride()}"
        )
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(
                f"{name} is on {dev} but {first_name} is on {first}: "
                "all tensors must share a device"
            )
    if first.type != "cuda" and not (first.type == "cpu" and interpreting()):
        raise ValueError(
            f"{first_name} is on {first}: Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 with CPU tensors); use the *_ref functions on the CPU"
        )
    return first
