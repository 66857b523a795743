"""Model-written code runs isolated: no network, no processes, no writes outside its directory,
bounded in time and memory."""

from __future__ import annotations

from detlora.study.sandbox import isolation, run_python_checks


def test_passing_and_failing_checks():
    assert run_python_checks("def f(x):\n    return 2 * x", ["assert f(2) == 4"]).passed
    r = run_python_checks("def f(x):\n    return 3 * x", ["assert f(2) == 4"])
    assert not r.passed and not r.timed_out and "AssertionError" in r.detail
    assert not run_python_checks("def f(:", []).passed  # a syntax error


def test_no_network_processes_or_outside_writes(tmp_path):
    outside = tmp_path / "written.txt"
    for code in ("import socket",
                 "import importlib; importlib.import_module('_socket')",
                 "import os; os.system('true')",
                 "import os; os.fork()",
                 "import subprocess",
                 "import ctypes",
                 f"open({str(outside)!r}, 'w').write('x')",
                 f"import os; os.remove({str(outside)!r})"):
        r = run_python_checks(code, [])
        assert not r.passed, code
    assert not outside.exists()
    # Its own directory is writable, and the standard library is there.
    assert run_python_checks("open('here.txt', 'w').write('x')\nimport math, re, itertools\n"
                             "assert math.gcd(4, 6) == 2", []).passed


def test_time_and_memory_limits():
    r = run_python_checks("while True:\n    pass", [], timeout_s=1.5)
    assert not r.passed and r.timed_out
    r = run_python_checks("x = bytearray(4 << 30)", [], memory_bytes=1 << 30)
    assert not r.passed and "MemoryError" in r.detail
    assert "audit hook" in isolation()
