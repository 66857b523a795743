"""``detlora replay`` (the kernel replay study) runs on a CPU through the interpreter."""

from detlora.cli import main


def test_replay_prints_the_reproducibility_table(capsys):
    assert main(["replay", "--executions", "2", "--hidden", "160"]) == 0
    out = capsys.readouterr().out
    for name in ("torch_ref", "atomic", "unsplit", "ordered", "ordered_bi", "tree"):
        assert f" {name} " in out
    assert "CPU (Triton interpreter)" in out
    # Every deterministic reduction repeats bit for bit: '0/1' differing comparisons.
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert rows and all(row[2] == "0/1" for row in rows)
