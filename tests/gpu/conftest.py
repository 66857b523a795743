"""GPU tier: every test here needs CUDA and is skipped cleanly without it."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu runs on the GPU machine)")
    for item in items:
        if "gpu" in item.path.parts:
            item.add_marker(skip)
