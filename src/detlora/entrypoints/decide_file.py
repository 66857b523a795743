"""``detlora decide``: typed questions over a JSON-lines file of states, answers as JSON lines.

Each input line is an object with a ``"state"`` (a string, an object or an array: a comment
to moderate, a ticket, a transcript) and optionally ``"lora"`` (an adapter name given with
``--lora NAME=DIR``); its other fields (an id, a gold label) are copied to its output line
beside ``"answers"`` (per question its probabilities, as ``LLM.decide`` and ``/v1/decisions``
give them), ``"fingerprint"``, ``"prompt_tokens"`` and ``"cached_tokens"``. The questions
are one JSON object (``--questions``, inline or a file), asked about every state; all reads
run in one ``LLM.decide`` call, so the instructions' and the questions' shared prefix is
computed once. Every line is checked before the model loads: a bad one is an error naming
the file and the line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from detlora.decisions import parse_questions
from detlora.json_files import read_jsonl_objects

RESERVED = ("answers", "fingerprint", "prompt_tokens", "cached_tokens")


@dataclass(frozen=True)
class StateLine:
    line: int  # 1-based line number in the input file
    state: Any
    lora: str | None
    extra: dict[str, Any]  # the line's other fields, copied to its output


def read_questions(value: str) -> dict[str, Any]:
    """``--questions``: a JSON object, inline or in a file; checked as ``LLM.decide`` checks
    it."""
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--questions {value}: neither a JSON object nor a file")
        text = path.read_text()
    try:
        questions = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--questions is not valid JSON: {e}") from None
    parse_questions(questions)  # the question's problem, named, before the model loads
    return questions


def read_states(path: Path, *, adapters: set[str], default_lora: str | None) -> list[StateLine]:
    """Every state line of ``path`` (blank lines skipped), checked: a ValueError names the
    file and line of the first bad one."""
    if not path.is_file():
        raise ValueError(f"--states file {path} does not exist")
    rows = []
    for n, row in read_jsonl_objects(path, key="state"):
        state = row["state"]
        if state is None or isinstance(state, (bool, int, float)):
            raise ValueError(f"{path}:{n}: \"state\" must be a string, an object or an array, "
                             f"got {json.dumps(state)}")
        lora = row.get("lora", default_lora)
        if lora is not None and not isinstance(lora, str):
            raise ValueError(f'{path}:{n}: "lora" must be an adapter name (a string) or null, '
                             f"got {lora!r}")
        if lora is not None and lora not in adapters:
            raise ValueError(f"{path}:{n}: adapter {lora!r} was not given with --lora "
                             f"NAME=DIR (known: {sorted(adapters)})")
        clash = sorted(k for k in row if k in RESERVED)
        if clash:
            raise ValueError(f"{path}:{n}: fields {clash} are the output's own: rename them")
        extra = {k: v for k, v in row.items() if k not in ("state", "lora")}
        rows.append(StateLine(n, state, lora, extra))
    if not rows:
        raise ValueError(f"{path} holds no states")
    return rows


def write_decisions(rows: list[StateLine], decisions: list[Any], out: TextIO) -> None:
    for row, d in zip(rows, decisions, strict=True):
        out.write(json.dumps({**row.extra, **({"lora": row.lora} if row.lora else {}),
                              "answers": d.answers, "fingerprint": d.fingerprint,
                              "prompt_tokens": d.prompt_tokens,
                              "cached_tokens": d.cached_tokens}) + "\n")


def run_decide(llm: Any, rows: list[StateLine], questions: dict[str, Any], *,
               instructions: Any, loras: dict[str, Any], out: Path | None,
               progress: bool) -> int:
    """Answer every line's questions in one call and write the answers in line order."""
    decisions = llm.decide([r.state for r in rows], questions, instructions=instructions,
                           lora_request=[loras[r.lora] if r.lora else None for r in rows],
                           use_tqdm=progress)
    if out is None:
        write_decisions(rows, decisions, sys.stdout)
    else:
        with out.open("w") as f:
            write_decisions(rows, decisions, f)
    return len(decisions)


__all__ = ["StateLine", "read_questions", "read_states", "run_decide", "write_decisions"]
