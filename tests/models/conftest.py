"""tests/models: puts this directory on sys.path (pytest runs with --import-mode=importlib)
so test files can import the tiny_hf helpers."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
