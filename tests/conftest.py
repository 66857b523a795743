"""Test setup: without CUDA, kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before any kernel module is imported, which is why it is set
here, at collection time, and why kernel tests import ``detlora.ops.*`` inside the test files.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def sm90_compile():
    """``run(script, arg) -> list``: run a compile-for-sm_90 script (tools/compile_sm90.py) in a
    fresh interpreter without TRITON_INTERPRET, with ``json.dumps(arg)`` as its argument, and
    return the JSON list it prints last. Skips the test when Triton's ptxas is missing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root)])

    def run(script: str, arg: object) -> list:
        proc = subprocess.run([sys.executable, "-c", script, json.dumps(arg)], cwd=root,
                              env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run
