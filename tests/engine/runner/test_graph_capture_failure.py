"""A failed CUDA-graph capture names its first error: the one at the end of a capture only says
an earlier call invalidated it."""

from __future__ import annotations

import sys

import pytest
from tests.helpers.fake_stderr import FakeStderr

from detlora.engine.runner.graph_capture import describe_capture_failure


def _illegal_call() -> None:
    raise RuntimeError("operation not permitted when stream is capturing")


def _capture() -> None:
    try:
        _illegal_call()
    finally:  # as torch.cuda.graph's __exit__ ends the capture, raising again
        raise RuntimeError("operation failed due to a previous error during capture")


def test_names_the_first_error_and_its_line() -> None:
    try:
        _capture()
    except RuntimeError as e:
        text = describe_capture_failure(e)
    first, last = text.split(" -> ")
    assert first.startswith("RuntimeError: operation not permitted when stream is capturing")
    assert last.startswith("RuntimeError: operation failed due to a previous error")
    assert "(at " not in text  # no detlora frame raised it: none is named


def test_an_error_alone_is_described_as_it_is() -> None:
    try:
        raise ValueError("scratch must grow during capture")
    except ValueError as e:
        assert describe_capture_failure(e) == "ValueError: scratch must grow during capture"


def test_the_frame_named_is_detlora_s_where_the_first_error_arose() -> None:
    from detlora import SamplingParams

    try:
        try:
            SamplingParams(temperature=-1.0)
        finally:
            raise RuntimeError("capture ended")
    except RuntimeError as e:
        text = describe_capture_failure(e)
    assert text.startswith("ValueError: temperature must be >= 0, got -1.0 -> "
                           "RuntimeError: capture ended (at ")
    assert "config.py:" in text and text.endswith("in __post_init__)")


def test_gc_paused_collects_first_then_keeps_the_gc_off() -> None:
    import gc
    import weakref

    from detlora.engine.runner.graph_capture import gc_paused

    class Node:
        pass

    node = Node()
    node.self = node  # a cycle: only the GC frees it
    dead = weakref.ref(node)
    del node
    assert gc.isenabled() and dead() is not None
    with gc_paused():
        assert dead() is None  # collected on entry, before any capture starts
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with gc_paused():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()  # restored on errors
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a GC its caller had off stays off
    finally:
        gc.enable()


def test_the_runner_captures_with_the_gc_paused(monkeypatch) -> None:
    import gc

    import torch

    import detlora.engine.runner.model_runner as mr

    seen = []

    class FakeGraphs:
        feed = None
        pool = None
        buckets = (1, 2)

        def __init__(self, *args, **kwargs) -> None:
            pass

        def graph_keys(self) -> list:
            return list(self.buckets)

        def capture(self, *args) -> None:
            seen.append(gc.isenabled())
            for _ in self.buckets:
                args[-1]()  # the progress bar's tick

    monkeypatch.setattr(mr, "DecodeGraphs", FakeGraphs)
    monkeypatch.setattr(mr, "StepGraphs", FakeGraphs)
    runner = object.__new__(mr.ModelRunner)
    runner.device, runner.max_model_len, runner.block_size = torch.device("cpu"), 64, 16
    runner.num_adapters, runner.graph_error = None, None
    runner._decode_forward = lambda batch: ()
    runner._step_graph_forward = lambda rows: ((lambda batch: ()), None)
    runner._capture(max_num_seqs=4, max_num_batched_tokens=64)
    assert seen == [False, False] and gc.isenabled()
    assert runner.graphs is not None and runner.step_graphs is not None


@pytest.mark.parametrize(("tty", "enabled", "total", "shown"), [
    (True, True, 3, True),
    (False, True, 3, False),  # stderr is not a terminal
    (True, False, 3, False),  # a tensor-parallel worker's runner
    (True, True, 0, False),  # nothing to capture
])
def test_capture_progress_shows_only_on_a_terminal_with_graphs_to_capture(
        monkeypatch, tty, enabled, total, shown) -> None:
    from detlora.engine.runner.graph_capture import capture_progress

    err = FakeStderr(tty)
    monkeypatch.setattr(sys, "stderr", err)
    with capture_progress(total, enabled=enabled) as bar:
        assert bar.disable is not shown
        for _ in range(total):
            bar.update()
    text = err.getvalue()
    assert ("capturing CUDA graphs:" in text and f"/{total} [" in text) is shown
    assert shown or text == ""


@pytest.mark.parametrize("progress", [True, False])
def test_the_runner_counts_every_graph_it_captures(monkeypatch, progress) -> None:
    import torch

    import detlora.engine.runner.model_runner as mr

    class FakeGraphs:
        feed = None
        pool = None

        def __init__(self, *args, buckets=(1, 2, 4), **kwargs) -> None:
            self.buckets = list(buckets)

        def graph_keys(self) -> list:
            return self.buckets

        def capture(self, *args) -> None:
            for _ in self.buckets:
                args[-1]()

    err = FakeStderr(True)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(mr, "DecodeGraphs", FakeGraphs)
    monkeypatch.setattr(mr, "StepGraphs", FakeGraphs)
    monkeypatch.setattr(mr, "step_graph_buckets", lambda t, s: [(16, 1), (16, 4)])
    runner = object.__new__(mr.ModelRunner)
    runner.device, runner.max_model_len, runner.block_size = torch.device("cpu"), 64, 16
    runner.num_adapters, runner.graph_error = None, None
    runner._decode_forward = lambda batch: ()
    runner._step_graph_forward = lambda rows: ((lambda batch: ()), None)
    bars, real = [], mr.capture_progress

    def capture_progress(total, *, enabled):
        bars.append(real(total, enabled=enabled))
        shown.append(not bars[-1].disable)  # closing a bar disables it
        return bars[-1]

    shown = []
    monkeypatch.setattr(mr, "capture_progress", capture_progress)
    runner._capture(max_num_seqs=4, max_num_batched_tokens=64, progress=progress)
    # 3 decode graphs and 2 step graphs, one bar; none unless asked (the engine's rank 0).
    [bar] = bars
    assert shown == [progress] and bar.total == 5
    assert bar.n == (5 if progress else 0)  # a disabled bar counts nothing
    assert ("capturing CUDA graphs:" in err.getvalue()) is progress
