"""A failed CUDA-graph capture names its first error: the one at the end of a capture only says
an earlier call invalidated it."""

from __future__ import annotations

from detlora.engine.graph_capture import describe_capture_failure


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
