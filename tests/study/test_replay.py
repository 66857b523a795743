"""The replay harness must see variation when there is some, and none when there is none."""

import itertools

import pytest
import torch

from detlora.study.replay import replay


def test_identical_outputs_give_zero():
    x = torch.randn(5, 7)
    stats = replay(lambda: x * 2, executions=10)
    assert stats.comparisons == 9 and stats.differing == 0
    assert stats.max_abs_diff == 0 and stats.differing_element_fraction == 0


def test_varying_outputs_are_counted_exactly():
    base = torch.zeros(4)
    counter = itertools.count()

    def op():
        i = next(counter)
        out = base.clone()
        if i % 3 == 1:  # executions 1, 4, 7 differ in one element by 0.5
            out[2] = 0.5
        return out

    stats = replay(op, executions=9, chunk=2)
    assert stats.comparisons == 8 and stats.differing == 3
    assert stats.differing_element_fraction == pytest.approx(3 / 32)
    assert stats.max_abs_diff == 0.5 and stats.mean_abs_diff == pytest.approx(1.5 / 32)


def test_needs_two_executions():
    with pytest.raises(ValueError, match="executions must be >= 2"):
        replay(lambda: torch.zeros(1), 1)
