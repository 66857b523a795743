"""tests/lora: puts this directory on sys.path (pytest runs with --import-mode=importlib) so
test files can import adapter_files, and provides a tiny model with two adapter slots."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from adapter_files import tiny_model


@pytest.fixture
def model():
    return tiny_model()
