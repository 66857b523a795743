"""The ``meta`` block of a results file: where, on what and from which commit it was measured."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def environment() -> dict[str, str]:
    """GPU, driver, torch and triton versions, and the host (``host``)."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    driver = "none"
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip().splitlines()[0]
    return {"gpu": gpu, "driver": driver, "torch": torch.__version__, "triton": triton.__version__,
            "host": host()}


def host() -> str:
    """The host's CPU model, logical CPUs and 1-minute load when the run started: host-bound
    figures (serving, many adapters) move with the machine, not only with the GPU."""
    model = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = ""
    with contextlib.suppress(OSError, AttributeError):
        load = f", load {os.getloadavg()[0]:.2f}"
    return f"{model}, {os.cpu_count()} CPUs{load}"


def commit_id() -> str:
    """The checkout's commit: ``$DETLORA_COMMIT`` if set (a copy without .git), else git's."""
    env = os.environ.get("DETLORA_COMMIT")
    return env if env else git_commit(REPO_ROOT)


def git_commit(root: Path) -> str:
    """HEAD's hash, with ``-dirty`` when tracked files differ from it (as ``git describe
    --dirty``): results from edits not committed, or from a copy whose .git is older than its
    files, are not filed under a commit that did not make them. "unknown" without git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=root).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def results_meta(command: str) -> dict[str, str]:
    """GPU, driver, torch, triton, host, commit, UTC date and the command that made the
    results."""
    return {
        **environment(),
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }
