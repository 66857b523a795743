"""The paper's figures, set beside the study's own in every table of the report.

The figures are data (``paper.json``, with the section or table each comes from), read once
here. The paper's reductions map onto detlora's: Atomic Split-K=8 is ``atomic``, Split-K=1
``unsplit``, Deterministic Split-K=8 ``ordered``; its earlier design with a separate
reduction launch is ``tree``. ``ordered_bi``, ``in_gemm`` and the ``batch_invariant`` level
have no counterpart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _figures(section: str) -> dict[str, Any]:
    """One section of paper.json without its ``_section`` label."""
    return {k: v for k, v in _DATA[section].items() if k != "_section"}


_DATA: dict[str, Any] = json.loads((Path(__file__).with_name("paper.json")).read_text())

TITLE: str = _DATA["title"]
CITATION = f'"{TITLE}" (Balusamy and Mohan, arXiv 2611.10334, 2026)'
NAMES: dict[str, str] = _DATA["names"]  # detlora reduction -> the paper's name for it
REPLAY: dict[str, str] = _figures("replay")  # reduction -> comparisons that differed
REPEAT: dict[tuple[str, str], str] = {  # (task, reduction) -> changed outputs and flips
    tuple(key.split("/")): v for key, v in _figures("repeat").items()}
CROSS_BATCH_FIXED: dict[str, str] = _figures("cross_batch_fixed")
CROSS_BATCH_CHANGED: dict[str, str] = _DATA["cross_batch_changed"]
DECISIONS: dict[str, dict[str, str]] = _figures("decisions")
TRACE: str = _DATA["trace"]["text"]
PERFORMANCE: str = _DATA["performance"]["text"]
