"""Run model-written Python with its tests, isolated: the study executes code it did not write.

Each check runs ``python -I -S`` (no user site, no environment, no site-packages) in a fresh
temporary directory with an empty environment and a wall-clock timeout, under resource
limits on POSIX (CPU seconds, address space, file size; child processes too, where the user
is not root). A prelude installs an audit hook that refuses process creation, sockets,
ctypes and any file change outside that directory; where user namespaces work (``unshare
--user --net``) the process also runs in an empty network namespace. The code passes when
the interpreter exits with status 0 within the timeout. This guards against a model's
mistakes, not a determined attacker: run studies of untrusted models in a container.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Runs before the model's code. The audit hook (PEP 578) cannot be removed once installed: it
# refuses process creation, signals, sockets, ctypes, file changes outside the working
# directory and writes outside it; the modules for them are made unimportable as well.
_PRELUDE = """\
import os as _os
import sys as _sys

_HERE = _os.path.realpath(_os.getcwd())
_BLOCKED = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
            "os.kill", "os.killpg", "os.remove", "os.rmdir", "os.rename", "os.truncate",
            "os.chmod", "os.chown", "os.link", "os.symlink", "os.chdir", "os.putenv",
            "os.unsetenv", "subprocess.", "socket.", "ctypes.", "shutil.", "webbrowser.",
            "urllib.", "http.", "ftplib.", "smtplib.", "pty.", "resource.setrlimit")


def _guard(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args and isinstance(args[0], (str, bytes)) and len(args) > 1:
        path, mode = args[0], args[1] or "r"
        if any(c in str(mode) for c in "wax+"):
            real = _os.path.realpath(_os.fsdecode(path))
            if not real.startswith(_HERE + _os.sep):
                raise PermissionError(f"sandbox: writing {real} is not allowed")


_sys.addaudithook(_guard)
for _name in ("socket", "_socket", "ssl", "_ssl", "ctypes", "_ctypes", "subprocess",
              "_posixsubprocess", "multiprocessing", "asyncio", "urllib", "http", "pty"):
    _sys.modules[_name] = None
del _name, _guard
"""


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    timed_out: bool
    detail: str  # the last line of stderr, or why it did not run


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """``unshare`` arguments that give a process no network, or () where that is refused."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return ()
    prefix = (exe, "--user", "--map-root-user", "--net", "--")
    try:
        ok = subprocess.run([*prefix, "/bin/true"], capture_output=True, timeout=10,
                            check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return prefix if ok else ()


def isolation() -> str:
    """What isolates the checks on this machine, for the report."""
    net = "an empty network namespace" if network_namespace_prefix() else \
        "no network modules (no namespace: unshare refused)"
    return (f"python -I -S in a temporary directory, empty environment, an audit hook "
            f"refusing processes, sockets, ctypes and file changes outside it, {net}, "
            "CPU/memory/file-size limits")


def _limits(cpu_s: int, memory_bytes: int) -> None:  # pragma: no cover - in the child
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setsid()


def run_python_checks(code: str, tests: tuple[str, ...] | list[str], *,
                      timeout_s: float = 10.0, memory_bytes: int = 1 << 30) -> SandboxResult:
    """Run ``code`` followed by ``tests`` (assert lines) in the sandbox."""
    source = _PRELUDE + "\n" + code + "\n\n" + "\n".join(tests) + "\n"
    with tempfile.TemporaryDirectory(prefix="detlora-check-") as tmp:
        script = Path(tmp) / "check.py"
        script.write_text(source)
        prefix = network_namespace_prefix()
        use_limits = os.name == "posix"
        cmd = [*prefix, sys.executable, "-I", "-S", str(script)]
        # The CPU limit backs up the wall clock (a child that escapes the timeout); it lies
        # above it, and a kill by either one counts as timing out.
        cpu = math.ceil(timeout_s) + 1
        try:
            proc = subprocess.run(
                cmd, cwd=tmp, env={}, capture_output=True, text=True, timeout=timeout_s,
                check=False, stdin=subprocess.DEVNULL,
                preexec_fn=(lambda: _limits(cpu, memory_bytes)) if use_limits else None,
            )
        except subprocess.TimeoutExpired:
            return SandboxResult(False, True, f"timed out after {timeout_s:g} s")
        except OSError as e:
            return SandboxResult(False, False, f"could not run: {e}")
    if use_limits and proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return SandboxResult(False, True, f"exceeded the CPU time limit of {cpu} s")
    err = proc.stderr.strip().splitlines()
    return SandboxResult(proc.returncode == 0, False, err[-1] if err else "")
