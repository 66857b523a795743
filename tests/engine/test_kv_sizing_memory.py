"""The CUDA sizing of the KV pages and the Mamba-2 state cache (engine/runner/kv_sizing.py)
against a fake caching allocator: blocks that the allocator caches from freed tensors count
for neither, the state cache and the KV pages come out of one budget (the state counted
once), and when an earlier engine holds the memory the error says so instead of asking for
"max_num_seqs at most 0".
"""

from __future__ import annotations

import pytest
import torch

from detlora.engine.runner import kv_sizing

GIB = 2**30
TOTAL = 140 * GIB
CONTEXT = GIB // 2  # outside PyTorch: the CUDA context
WEIGHTS = 3 * GIB
ACTIVATIONS = 2 * GIB
PER_SEQ = 28704  # a tiny Nemotron-H's slot (tests/helpers/tiny_nemotron_h.py, chunk 16)
BLOCK = 2**20  # bytes of one KV page


class FakeCuda:
    """PyTorch's caching allocator as kv_sizing sees it: ``live`` bytes in tensors,
    ``reserved`` bytes held by the allocator (live + cached free blocks, returned by
    empty_cache), ``CONTEXT`` outside it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, live: int, cached: int) -> None:
        self.live, self.reserved, self.peak = live, live + cached, live
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: self.reset())
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda *a: (TOTAL - self.reserved - CONTEXT, TOTAL))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.live)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: self.reserved)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)

    def reset(self) -> None:
        self.peak = self.live

    def empty_cache(self) -> None:
        self.reserved = self.live

    def alloc(self, n: int) -> None:
        self.live += n
        self.reserved = max(self.reserved, self.live)
        self.peak = max(self.peak, self.live)

    def free(self, n: int) -> None:
        self.live -= n  # the block stays cached (reserved) until empty_cache


class Model(torch.nn.Module):
    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda, self.bound = cuda, 0

    def state_bytes_per_slot(self) -> int:
        return PER_SEQ

    def kv_cache_bytes_per_token(self) -> int:
        return BLOCK // 16

    def release_state_cache(self) -> None:
        self.cuda.free(self.bound)
        self.bound = 0


class Runner:
    """What ModelRunner allocates: the scratch pages and the state cache (bound to the
    model, which keeps it until released), and a step's activations while it runs."""

    def __init__(self, model: Model, num_blocks: int, max_num_seqs: int) -> None:
        self.cuda, self.kv = model.cuda, num_blocks * BLOCK
        model.bound = PER_SEQ * (max_num_seqs + 1)
        self.cuda.alloc(self.kv + model.bound)

    def execute(self, step, decode_only: bool) -> None:
        self.cuda.alloc(ACTIVATIONS)
        self.cuda.free(ACTIVATIONS)

    def __del__(self) -> None:
        self.cuda.free(self.kv)


def _blocks(monkeypatch, *, live: int = WEIGHTS, cached: int = 0, allocated_before: int = 0,
            max_num_seqs: int = 16, utilization: float = 0.3) -> int:
    cuda = FakeCuda(monkeypatch, live=live, cached=cached)
    model = Model(cuda)
    blocks = kv_sizing.cuda_num_blocks(
        lambda n: Runner(model, n, max_num_seqs), model, device=torch.device("cuda"),
        block_size=16, max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
        max_model_len=160, gpu_memory_utilization=utilization,
        allocated_before=allocated_before)
    assert cuda.live == live  # the throw-away runner and state cache are gone
    return blocks


def test_cached_blocks_of_freed_tensors_count_for_nothing(monkeypatch):
    """45 GiB cached from earlier work (the 4B-shape kernel tests, say) exceed the 42 GiB
    that 0.3 allows, yet the engine gets the pages it gets on a clean device."""
    clean = _blocks(monkeypatch)
    assert _blocks(monkeypatch, cached=45 * GIB) == clean


def test_state_and_pages_share_one_budget(monkeypatch):
    """The pages get the allowance less the weights, the memory outside PyTorch, and the
    profiled peak's state cache (max_num_seqs + 1 slots), scratch pages and activations;
    the state check stops where that budget does."""
    seqs, scratch = 16, 4  # the profiling step: 64 tokens on pages 0..3
    allowed = int(TOTAL * 0.3) - WEIGHTS - CONTEXT
    state = PER_SEQ * (seqs + 1)
    assert _blocks(monkeypatch, max_num_seqs=seqs) == \
        (allowed - state - scratch * BLOCK - ACTIVATIONS) // BLOCK
    fits = allowed // PER_SEQ - 1  # the largest max_num_seqs whose states fit
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        _blocks(monkeypatch, max_num_seqs=fits)  # state passes; nothing left for pages
    with pytest.raises(ValueError, match=f"lower max_num_seqs to at most {fits} "):
        _blocks(monkeypatch, max_num_seqs=fits + 1)


def test_an_engine_still_alive_is_named_not_max_num_seqs(monkeypatch):
    """A first engine at 0.3 still holding its pages when a second is built at 0.3 (the
    failure seen on the H200): the error names it and prints the tiny state in KiB."""
    held = int(TOTAL * 0.3) - GIB
    with pytest.raises(ValueError) as err:
        _blocks(monkeypatch, live=held + WEIGHTS, cached=5 * GIB, allocated_before=held)
    msg = str(err.value)
    assert msg.startswith("max_num_seqs=16 needs 476.5 KiB of Mamba-2 state (28.0 KiB per "
                          "sequence"), msg
    assert "at most" not in msg and "0.0 MiB" not in msg
    assert "no GPU memory left for the Mamba-2 state" in msg
    assert "41.00 GiB were already allocated by this process before this engine was built" \
        in msg and "shutdown()" in msg
    assert msg.index("41.00 GiB were") < msg.index("this engine's model takes 3.00 GiB")


def test_size_text_keeps_a_unit_or_more():
    assert [kv_sizing.size_text(n) for n in (0, 28704, 2**20, 5 * 2**29, 80 * 2**30)] == \
        ["0.0 KiB", "28.0 KiB", "1.00 MiB", "2.50 GiB", "80.00 GiB"]
