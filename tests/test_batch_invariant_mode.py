"""The batch-invariant mode: its state machine (on, off, nesting, restore after exceptions,
registrations gone after exit) for the CUDA key, and its routing and fallbacks exercised on CPU
tensors under Triton's interpreter (``device_type="cpu"``)."""

import pytest
import torch
import torch.nn.functional as F

# Names, not the module: detlora/__init__.py may export the function batch_invariant, which
# then shadows the submodule as an attribute of the package.
from detlora.batch_invariant import (
    ROUTED_OPS,
    batch_invariant,
    disable_batch_invariant_mode,
    enable_batch_invariant_mode,
    is_batch_invariant_mode_enabled,
)
from detlora.ops import matmul as mm


def _registered(op: str, key: str = "CUDA") -> bool:
    """True when the dispatch table's kernel for ``key`` is the mode's Python override."""
    table = torch._C._dispatch_dump_table(op)
    return any(line.startswith(f"{key}:") and "batch_invariant.py" in line
               for line in table.splitlines())


def _state(key: str = "CUDA") -> tuple[bool, list[bool]]:
    return is_batch_invariant_mode_enabled(), [_registered(op, key) for op in ROUTED_OPS]


OFF = (False, [False] * 5)
ON = (True, [True] * 5)


@pytest.fixture(autouse=True)
def _mode_off_around_each_test():
    disable_batch_invariant_mode()
    yield
    disable_batch_invariant_mode()


def test_enable_and_disable_add_and_remove_registrations():
    assert _state() == OFF
    enable_batch_invariant_mode()
    assert _state() == ON
    enable_batch_invariant_mode()  # already on: no second registration
    assert _state() == ON
    disable_batch_invariant_mode()
    assert _state() == OFF
    disable_batch_invariant_mode()
    assert _state() == OFF


def test_context_manager_nests_and_restores_each_level():
    with batch_invariant():
        assert _state() == ON
        with batch_invariant():
            assert _state() == ON
        assert _state() == ON  # the inner exit keeps the outer mode
        with batch_invariant(False):
            assert _state() == OFF
        assert _state() == ON
        disable_batch_invariant_mode()  # turned off by hand inside the block
    assert _state() == OFF
    enable_batch_invariant_mode()
    with batch_invariant(False):
        enable_batch_invariant_mode()
    assert _state() == ON


def test_state_is_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"), batch_invariant():
        assert _state() == ON
        raise RuntimeError("boom")
    assert _state() == OFF
    enable_batch_invariant_mode()
    with pytest.raises(KeyError), batch_invariant(False):
        raise KeyError("x")
    assert _state() == ON


def test_device_types_are_checked_and_not_mixed():
    with pytest.raises(ValueError, match="device_type"):
        enable_batch_invariant_mode("tpu")
    with pytest.raises(ValueError, match="device_type"), batch_invariant(device_type="xla"):
        pass
    with batch_invariant(device_type="cpu"):
        assert _state("CPU") == ON
        assert _state("CUDA")[1] == [False] * 5
        with pytest.raises(ValueError, match="already on"), batch_invariant():
            pass
        assert _state("CPU") == ON
    assert _state("CPU") == OFF


@pytest.fixture
def spy(monkeypatch):
    """Counts the detlora matmul wrappers the mode calls (the real kernels still run)."""
    calls = []
    for name in ("matmul", "add_bias_mm", "bmm"):
        real = getattr(mm, name)
        monkeypatch.setattr(mm, name, lambda *a, _real=real, _name=name, **k: (
            calls.append(_name), _real(*a, **k))[1])
    return calls


def test_routes_matmuls_to_detlora_bitwise(spy):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 40, generator=g)
    w = torch.randn(24, 40, generator=g)
    bias = torch.randn(24, generator=g)
    xs = torch.randn(2, 3, 40, generator=g)
    a3 = torch.randn(3, 5, 40, generator=g)
    b3 = torch.randn(3, 40, 7, generator=g)
    with batch_invariant(device_type="cpu"):
        got = {
            "mm": torch.mm(x, w.t()),
            "linear": F.linear(x, w, bias),  # -> addmm
            "linear3d": F.linear(xs, w),  # -> mm on the flattened rows
            "bmm": torch.bmm(a3, b3),
            "matmul4d": a3[None] @ b3[None],  # -> bmm
        }
    assert spy == ["matmul", "add_bias_mm", "matmul", "bmm", "bmm"]
    assert torch.equal(got["mm"], mm.linear(x, w))
    assert torch.equal(got["linear"], mm.linear(x, w, bias))
    assert torch.equal(got["linear3d"], mm.linear(xs.reshape(6, 40), w).reshape(2, 3, 24))
    assert torch.equal(got["bmm"], mm.bmm(a3, b3))
    assert torch.equal(got["matmul4d"][0], mm.bmm(a3, b3))


def test_uncovered_calls_fall_back_to_the_original_kernels(spy):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=g, dtype=torch.float64)
    y = torch.randn(8, 3, generator=g, dtype=torch.float64)
    b = torch.randn(3, generator=g, dtype=torch.float64)
    xf, yf, bf = x.float(), y.float(), b.float()
    expect = {
        "mm64": torch.mm(x, y),
        "bmm64": torch.bmm(x[None], y[None]),
        "addmm_beta": torch.addmm(bf, xf, yf, beta=2.0),
        "addmm_alpha": torch.addmm(bf, xf, yf, alpha=0.5),
        "int": torch.mm(x.long(), y.long()),
    }
    with batch_invariant(device_type="cpu"):
        got = {
            "mm64": torch.mm(x, y),
            "bmm64": torch.bmm(x[None], y[None]),
            "addmm_beta": torch.addmm(bf, xf, yf, beta=2.0),
            "addmm_alpha": torch.addmm(bf, xf, yf, alpha=0.5),
            "int": torch.mm(x.long(), y.long()),
        }
        with pytest.raises(RuntimeError):  # ATen's own shape error, not a detlora one
            torch.mm(xf, xf)
    assert spy == []
    for name, value in expect.items():
        assert torch.equal(got[name], value), name


def test_log_softmax_and_mean_route_with_any_dims(monkeypatch):
    import detlora.ops.reductions as reductions
    import detlora.ops.softmax as softmax

    seen = []

    def fake(kind):
        # Calls torch inside a routed op: the mode must hand these to ATen, not recurse.
        def kernel(rows):
            seen.append((kind, tuple(rows.shape), rows.is_contiguous()))
            if kind == "log_softmax":
                return torch.log_softmax(rows, dim=-1)
            return rows.mean(dim=-1)
        return kernel

    monkeypatch.setattr(softmax, "log_softmax", fake("log_softmax"), raising=False)
    monkeypatch.setattr(reductions, "mean", fake("mean"), raising=False)
    x = torch.randn(4, 6, 10, generator=torch.Generator().manual_seed(2))
    with batch_invariant(device_type="cpu"):
        ls = torch.log_softmax(x, dim=1)
        m_last = x.mean(-1)
        m_multi = x.mean((0, 2), keepdim=True)
        m_all = x.half().mean(dtype=torch.float32)
    assert seen == [("log_softmax", (40, 6), True), ("mean", (24, 10), True),
                    ("mean", (6, 40), True), ("mean", (1, 240), True)]
    assert torch.allclose(ls, torch.log_softmax(x, dim=1), atol=1e-6)
    assert ls.is_contiguous()
    assert torch.allclose(m_last, x.mean(-1), atol=1e-6)
    assert m_multi.shape == (1, 6, 1)
    assert torch.allclose(m_multi, x.mean((0, 2), keepdim=True), atol=1e-6)
    assert m_all.dtype == torch.float32 and m_all.shape == ()
    assert torch.allclose(m_all, x.half().float().mean(), atol=1e-6)


def test_log_softmax_and_mean_fall_back_while_wrappers_are_missing(monkeypatch):
    import detlora.ops.reductions as reductions
    import detlora.ops.softmax as softmax

    monkeypatch.delattr(softmax, "log_softmax", raising=False)
    monkeypatch.delattr(reductions, "mean", raising=False)
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(3))
    with batch_invariant(device_type="cpu"):
        ls = torch.log_softmax(x, dim=-1)
        mn = x.mean(-1)
        m64 = x.double().mean(-1)
    assert torch.equal(ls, torch.log_softmax(x, dim=-1))
    assert torch.equal(mn, x.mean(-1))
    assert torch.equal(m64, x.double().mean(-1))
