"""tests/lora: a tiny model with two adapter slots."""

from __future__ import annotations

import pytest
from tests.helpers.adapter_files import tiny_model


@pytest.fixture
def model():
    return tiny_model()
