"""A checkpoint whose weights hold NaN or inf (corrupt bytes: safetensors has no checksum, or
values a narrower dtype cannot hold) is refused when loaded, naming the tensor."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from detlora.models.loader import load_model

NAME = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture
def ckpt(llama_dir, tmp_path) -> Path:
    return Path(shutil.copytree(llama_dir, tmp_path / "copy"))


def _edit(path: Path, name: str, fn) -> None:
    file = path / "model.safetensors"
    sd = load_file(file)
    fn(sd[name])
    save_file(sd, file, metadata={"format": "pt"})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_weight_is_refused_naming_it(ckpt, bad):
    _edit(ckpt, NAME, lambda t: t.view(-1)[7:9].fill_(bad))
    with pytest.raises(ValueError, match=rf"weight '{NAME}' in model\.safetensors holds 2 "
                                         r"non-finite values \(NaN or inf\).*corrupt"):
        load_model(ckpt)


def test_a_weight_that_overflows_the_load_dtype_is_refused(ckpt):
    _edit(ckpt, NAME, lambda t: t.view(-1)[0].fill_(1e6))  # fp32 holds it, fp16 does not
    load_model(ckpt)
    with pytest.raises(ValueError, match=rf"weight '{NAME}' .* overflows float16"):
        load_model(ckpt, dtype=torch.float16)


def test_four_kb_of_corrupt_bytes_in_the_data_region(ckpt):
    file = ckpt / "model.safetensors"
    data = bytearray(file.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0] + 4096
    data[start: start + 4096] = b"\xff" * 4096  # NaN as fp32
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"weight '.*' in model\.safetensors holds 1024 "
                                         r"non-finite values"):
        load_model(ckpt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_all_finite_sees_one_bad_value_anywhere(dtype):
    """The one-reduction check (aminmax) agrees with isfinite for NaN, +inf and -inf at the
    first, a middle and the last element, and for all-NaN, one-element and empty tensors."""
    from detlora.models.finite_weights import all_finite

    t = torch.randn(33, 65, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert all_finite(t) and all_finite(t[:, :0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in (0, 1000, t.numel() - 1):
            x = t.clone()
            x.view(-1)[index] = bad
            assert not all_finite(x) and not bool(torch.isfinite(x).all())
        assert not all_finite(torch.full((3,), bad, dtype=dtype))
        assert not all_finite(torch.tensor([bad], dtype=dtype))
