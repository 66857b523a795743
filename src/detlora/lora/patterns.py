"""Which modules an adapter config's patterns select, computed at a bounded cost.

PEFT matches ``target_modules`` (a string: ``re.fullmatch``), the keys of ``rank_pattern``
and ``alpha_pattern`` (``re.match(rf"(.*\\.)?({key})$", module)``, the first key that matches)
and ``layers_pattern`` (the layer index of a module) with Python's ``re``, whose backtracking
can take exponential time: a crafted pattern can stall whoever loads the adapter, here the
engine step that every request shares. These are PEFT's rules, with bounds:

* a pattern has at most ``MAX_PATTERN_CHARS`` characters, a config at most
  ``MAX_PATTERN_KEYS`` keys per field, and counted repetitions (``{m,n}``) whose bounds
  multiply to at most ``MAX_REPEAT_PRODUCT`` (compiling expands them); other ``{...}``
  syntax (the ``regex`` package's fuzzy matching, which ``re`` reads as literal text) is
  refused, so a pattern means what it meant to PEFT;
* patterns are checked with ``re`` (PEFT's syntax) and matched with the ``regex`` package
  (same semantics, a ``timeout``, and it releases the GIL) in a worker thread; the caller
  waits at most ``MATCH_BUDGET_S`` for all the matches of one config, then raises a
  ValueError naming the pattern. ``regex`` checks its timeout only now and then, so a
  runaway match may go on in the background for a while after that error; it never holds
  the caller.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_PATTERN_CHARS = 1024
MAX_PATTERN_KEYS = 4096
MAX_REPEAT_PRODUCT = 10_000
MATCH_BUDGET_S = 1.0
# PEFT's default layer index: the number after the first "<name>." (lazy: the first index).
_DEFAULT_LAYER = r".*?\.[^.]*\.(?P<idx>\d+)\."
_BRACES = re.compile(r"(?<!\\)\{([^}]*)\}")
_COUNTED = re.compile(r"(\d*)(?:,(\d*))?")


@dataclass(frozen=True)
class ModuleMatch:
    """What an adapter config says about one module."""

    targeted: bool  # target_modules (and layers_to_transform) select it
    rank_key: str | None  # the rank_pattern key that applies, if any
    alpha_key: str | None  # the alpha_pattern key that applies, if any


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def check_pattern(field: str, pattern: object, src: Path | str) -> str:
    """``pattern`` if it is a string within the bounds above, else a ValueError naming it."""
    if not isinstance(pattern, str):
        raise ValueError(f"{src}: {field} must be a string pattern, got {pattern!r}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"{src}: {field} pattern {_short(pattern)} has {len(pattern)} "
                         f"characters, more than the {MAX_PATTERN_CHARS} allowed")
    product = 1
    for m in _BRACES.finditer(pattern):
        counted = _COUNTED.fullmatch(m.group(1))
        if counted is None or not any(counted.groups()):
            raise ValueError(
                f"{src}: {field} pattern {_short(pattern)} uses {{{m.group(1)}}}, which is "
                "not a counted repetition ({m}, {m,}, {m,n}); regex-package extensions are "
                "not allowed (escape a literal brace as \\{)")
        lo, hi = counted.groups()
        product *= max(1, int(hi) if hi else int(lo or 0))
        if product > MAX_REPEAT_PRODUCT:
            raise ValueError(
                f"{src}: {field} pattern {_short(pattern)} has counted repetitions whose "
                f"bounds multiply to more than {MAX_REPEAT_PRODUCT}")
    return pattern


def check_pattern_keys(field: str, patterns: object, src: Path | str) -> None:
    """A rank_pattern / alpha_pattern mapping: at most MAX_PATTERN_KEYS bounded keys."""
    if not isinstance(patterns, Mapping):
        raise ValueError(f"{src}: {field} must map module patterns to numbers, "
                         f"got {patterns!r}")
    if len(patterns) > MAX_PATTERN_KEYS:
        raise ValueError(f"{src}: {field} has {len(patterns)} keys, more than the "
                         f"{MAX_PATTERN_KEYS} allowed")
    for key in patterns:
        check_pattern(f"{field} key", key, src)


class _Matcher:
    """The worker's side: compiles and matches, noting what it is working on."""

    def __init__(self, deadline: float) -> None:
        import regex  # a dependency of transformers; imported where patterns are matched

        self._regex = regex
        self._deadline = deadline
        self._compiled: dict[str, Any] = {}
        self.current = ""  # "<field> pattern <pattern>", for the caller's error

    def compile(self, what: str, pattern: str) -> Any:
        self.current = what
        if pattern not in self._compiled:
            try:
                re.compile(pattern)  # PEFT's syntax
                self._compiled[pattern] = self._regex.compile(pattern)
            except (re.error, self._regex.error, RecursionError, OverflowError) as e:
                raise ValueError(f"{what} is not a valid regular expression: {e}") from None
        return self._compiled[pattern]

    def search(self, what: str, pattern: str, text: str, *, full: bool = False) -> Any:
        compiled = self.compile(what, pattern)
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        fn = compiled.fullmatch if full else compiled.match
        return fn(text, timeout=left, concurrent=True)


def match_modules(cfg: Mapping[str, Any], modules: Sequence[str], src: Path | str,
                  budget_s: float | None = None) -> dict[str, ModuleMatch]:
    """For every module name, what the (checked) config says about it, as PEFT decides it.

    Raises ValueError when a pattern is invalid or the matches take more than ``budget_s``
    (default ``MATCH_BUDGET_S``) seconds in all."""
    budget = MATCH_BUDGET_S if budget_s is None else budget_s
    targets = cfg["target_modules"]
    rank_keys = list(cfg.get("rank_pattern") or {})
    alpha_keys = list(cfg.get("alpha_pattern") or {})
    layers = cfg.get("layers_to_transform")
    wanted = None if layers is None or layers == [] else (
        {layers} if isinstance(layers, int) else set(layers))
    layer_patterns = cfg.get("layers_pattern") or None
    if isinstance(layer_patterns, str):
        layer_patterns = [layer_patterns]
    deadline = time.monotonic() + budget
    matcher = _Matcher(deadline)

    def first_key(field: str, keys: list[str], module: str) -> str | None:
        for key in keys:
            if matcher.search(f"{field} key {_short(key)}", rf"(.*\.)?({key})$", module):
                return key
        return None

    def layer_of(module: str) -> int | None:
        for pattern in layer_patterns or [None]:
            if pattern is None:
                m = matcher.search("the default layer pattern", _DEFAULT_LAYER, module)
            else:
                m = matcher.search(f"layers_pattern {_short(pattern)}",
                                   rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
            if m is not None:
                return int(m.group("idx"))
        return None

    def targeted(module: str) -> bool:
        if isinstance(targets, str):
            return targets == "all-linear" or matcher.search(
                f"target_modules {_short(targets)}", targets, module, full=True) is not None
        if not (module in targets or any(module.endswith(f".{t}") for t in targets)):
            return False
        return wanted is None or layer_of(module) in wanted

    def work() -> dict[str, ModuleMatch]:
        return {m: ModuleMatch(targeted(m), first_key("rank_pattern", rank_keys, m),
                               first_key("alpha_pattern", alpha_keys, m)) for m in modules}

    result: list[dict[str, ModuleMatch]] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as e:  # handed to the caller
            failure.append(e)

    worker = threading.Thread(target=run, name="detlora-adapter-patterns", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()) + 0.05)
    if failure and not isinstance(failure[0], TimeoutError):
        e = failure[0]
        raise ValueError(f"{src}: {e}") if isinstance(e, ValueError) else e
    if not result:
        raise ValueError(
            f"{src}: matching {matcher.current} against the model's module names took more "
            f"than {_seconds(budget)} (a pattern that backtracks without end?); simplify "
            "the pattern")
    return result[0]


def _seconds(s: float) -> str:
    return f"{s:g} s" if math.isfinite(s) else "forever"
