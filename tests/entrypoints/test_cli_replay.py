"""``detlora replay`` (the kernel replay study) runs on a CPU through the interpreter."""

import sys

import pytest
from tests.helpers.fake_stderr import FakeStderr

from detlora.entrypoints.cli import main


def test_replay_prints_the_reproducibility_table(capsys):
    assert main(["replay", "--executions", "2", "--hidden", "160"]) == 0
    out = capsys.readouterr().out
    for name in ("torch_ref", "atomic", "unsplit", "ordered", "ordered_bi", "tree"):
        assert f" {name} " in out
    assert "CPU (Triton interpreter)" in out
    # Every deterministic reduction repeats bit for bit: '0/1' differing comparisons.
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert rows and all(row[2] == "0/1" for row in rows)


@pytest.mark.parametrize(("args", "message"), [
    (["--executions", "1"], "--executions: must be >= 2, got 1"),
    (["--hidden", "0"], "--hidden: must be >= 1, got 0"),
    (["--rank", "0"], "--rank: must be >= 1, got 0"),
])
def test_replay_refuses_bad_sizes_before_running(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_replay_rank_above_the_kernels_maximum_is_a_clear_error(capsys):
    assert main(["replay", "--executions", "2", "--hidden", "16", "--rank", "1000"]) == 2
    assert "rank 1000 is outside [1, 128]" in capsys.readouterr().err


@pytest.mark.parametrize(("tty", "args", "shown"), [
    (True, [], True),
    (False, [], False),  # not a terminal: no bar
    (True, ["--no-progress"], False),
])
def test_replay_bar_over_the_replays_only_on_a_terminal(capsys, monkeypatch, tty, args, shown):
    err = FakeStderr(tty)
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["replay", "--executions", "2", "--hidden", "16", *args]) == 0
    # 3 M on a CPU, each the torch reference and 5 reductions.
    assert ("replay: 100%" in err.getvalue() and "| 18/18 [" in err.getvalue()) == shown
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 18 and "%|" not in out  # the table whole, with no bar in it


def test_replay_table_progress_forced_writes_a_bar_whatever_stderr_is(monkeypatch):
    from detlora.study.replay_table import run_replay_table

    err = FakeStderr(False)
    monkeypatch.setattr(sys, "stderr", err)
    rows = run_replay_table(False, executions=2, hidden=16, progress=True)
    assert len(rows) == 18 and "replay: 100%" in err.getvalue()
