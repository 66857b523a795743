"""The serving suite's record of Triton compilations: the hooks' events, the JSON-lines file
they go to, reads from an offset, and the start-up hook that installs them in a server's
processes."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks.harness import compile_events

REPO = Path(__file__).resolve().parents[2]


def _fn(name: str) -> SimpleNamespace:
    params = [SimpleNamespace(name="x_ptr"), SimpleNamespace(name="n")]
    return SimpleNamespace(name=name, jit_function=SimpleNamespace(params=params))


def test_a_compilation_is_one_timed_event_with_its_key():
    events = []
    rec = compile_events.CompileRecorder(events.append)
    assert rec._pre(key=("k", 1), fn=_fn("kern")) is False  # the compile is never skipped
    rec._post(key=("k", 1), fn=_fn("kern"))
    rec._post(key="other", fn=_fn("late"))  # no cache-miss hook before it: no time
    assert [e["kernel"] for e in events] == ["kern", "late"]
    assert events[0]["seconds"] >= 0 and events[1]["seconds"] is None
    assert events[0]["params"] == ["x_ptr", "n"] and events[0]["key"] == "('k', 1)"
    assert events[0]["pid"] == os.getpid()


def test_events_append_to_the_log_and_read_from_an_offset(tmp_path, monkeypatch):
    log = tmp_path / "compiles.jsonl"
    assert compile_events.read_events(log) == ([], 0)  # nothing yet
    monkeypatch.setenv(compile_events.ENV, str(log))
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    rec = compile_events.install_from_env()
    assert knobs.runtime.jit_post_compile_hook == rec._post
    rec._post(key=1, fn=_fn("a"))
    first, offset = compile_events.read_events(log)
    rec._post(key=2, fn=_fn("b"))
    with log.open("a") as f:
        f.write('{"kernel": "half')  # a line still being written waits
    second, offset2 = compile_events.read_events(log, offset)
    assert [e["kernel"] for e in first] == ["a"] and [e["kernel"] for e in second] == ["b"]
    with log.open("a") as f:
        f.write('"}\n')
    third, _ = compile_events.read_events(log, offset2)
    assert third == [{"kernel": "half"}]


def test_the_start_up_hook_installs_only_when_asked(tmp_path):
    hooks = REPO / "benchmarks" / "harness" / "sitecustomize"
    probe = ("from triton import knobs; import json; "
             "print(json.dumps(knobs.runtime.jit_post_compile_hook is not None))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hooks), str(REPO),
                                                        str(REPO / "src")]))
    env.pop(compile_events.ENV, None)
    off = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True)
    env[compile_events.ENV] = str(tmp_path / "c.jsonl")
    on = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                        text=True, check=True)
    assert json.loads(off.stdout) is False and json.loads(on.stdout) is True
