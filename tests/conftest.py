"""Test setup: without CUDA, kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before any kernel module is imported, which is why it is set
here, at collection time, and why kernel tests import ``detlora.ops.*`` inside the test files.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
