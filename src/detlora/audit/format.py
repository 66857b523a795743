"""The audit log's format (version ``VERSION``): field helpers shared by the writers and
``detlora verify``.

A line is a JSON object with ``"v"`` (the format version) and ``"kind"``: ``"engine"`` (the
first line of every file: the engine that answered, its arguments and fingerprint parts) or
``"request"`` (one finished request or decision). Hashes are sha256, hex:

* ``ids_sha256``: over the token ids as little-endian int64;
* ``logprobs_sha256``: over the raw float bits (float64, little-endian; every value the engine
  returns is an fp32 or float64 number, so no bit is lost) of every returned logprob, in the
  order the engine returns them: per output position ``b"T"``, the entry count (uint32) and
  each (token id int64, value float64) pair (the chosen token first, then the top ones); then
  ``b"P"`` and the prompt positions the same way (with ``prompt_logprobs``); then ``b"L"`` and
  the label logprobs (decisions) in label order. Positions come first, so the hash of the
  first k positions of a replay can be compared with an aborted request's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from detlora.config import RequestOutputKind, SamplingParams, StructuredOutputsParams

VERSION = 1
ENGINE = "engine"
REQUEST = "request"

_PAIR = struct.Struct("<qd")


def utc_time(seconds: float) -> str:
    """ISO 8601 in UTC with microseconds, e.g. ``2026-03-01T12:34:56.789012Z`` (sorts as text)."""
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> datetime:
    """A ``--since``/``--until`` bound: an ISO date or date-time, UTC unless it says otherwise
    (ValueError naming the text)."""
    value = text.strip()
    if value.endswith("Z"):
        value = value[:-1] + "+00:00"
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO date or date-time (e.g. 2026-03-01 or "
                         "2026-03-01T12:00:00Z)") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def record_time(record: Mapping[str, Any]) -> datetime:
    return parse_time(record["time"])


def ids_sha256(ids: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


def value_of(entry: Any) -> float:
    """A logprobs value: a float, or an object with ``.logprob`` (``Logprob``)."""
    return entry if isinstance(entry, float) else float(entry.logprob)


def _positions(h: Any, entries: Sequence[Mapping[int, Any] | None]) -> None:
    """Each position as ``b"T"``, its entry count (uint32) and its (int64, float64) pairs,
    little-endian, packed in one call."""
    fmt = ["<"]
    args: list[Any] = []
    add = args.append
    for entry in entries:
        if entry is None:  # the first prompt position has none
            continue
        n = len(entry)
        fmt.append("cI" + "qd" * n if n != 1 else "cIqd")
        add(b"T")
        add(n)
        for t, v in entry.items():
            add(t)
            add(v if type(v) is float else value_of(v))
    if args:
        h.update(struct.pack("".join(fmt), *args))


def logprobs_sha256(logprobs: Sequence[Mapping[int, Any]] | None,
                    prompt_logprobs: Sequence[Mapping[int, Any] | None] | None = None,
                    label_token_ids: Sequence[int] | None = None,
                    label_logprobs: Mapping[int, Any] | None = None) -> str:
    """The hash of every returned logprob (see the module doc)."""
    h = hashlib.sha256()
    _positions(h, logprobs or ())
    if prompt_logprobs is not None:
        h.update(b"P")
        _positions(h, prompt_logprobs)
    if label_logprobs is not None:
        assert label_token_ids is not None
        h.update(b"L")
        h.update(b"".join(_PAIR.pack(t, value_of(label_logprobs[t])) for t in label_token_ids))
    return h.hexdigest()


# ---- sampling parameters ----

def params_to_json(params: SamplingParams) -> dict[str, Any]:
    """Every field of ``params`` (defaults applied), as JSON values that read back to equal
    parameters (floats round-trip exactly)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, RequestOutputKind):
            value = value.name.lower()
        elif isinstance(value, StructuredOutputsParams):
            value = {k: list(v) if isinstance(v, tuple) else v
                     for k, v in dataclasses.asdict(value).items()
                     if v is not None and v is not False}
        elif f.name == "logit_bias" and value is not None:
            value = {str(k): v for k, v in value.items()}
        out[f.name] = value
    return out


def params_from_json(data: Mapping[str, Any]) -> SamplingParams:
    """``params_to_json``'s inverse (ValueError naming a field that does not fit)."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"sampling_params has fields this detlora does not know: {unknown}")
    kwargs = dict(data)
    for name in ("stop_token_ids", "stop", "allowed_token_ids"):
        if isinstance(kwargs.get(name), list):
            kwargs[name] = tuple(kwargs[name])
    if kwargs.get("logit_bias") is not None:
        kwargs["logit_bias"] = {int(k): v for k, v in kwargs["logit_bias"].items()}
    if "output_kind" in kwargs:
        kwargs["output_kind"] = RequestOutputKind[str(kwargs["output_kind"]).upper()]
    so = kwargs.get("structured_outputs")
    if so is not None:
        so = dict(so)
        if isinstance(so.get("choice"), list):
            so["choice"] = tuple(so["choice"])
        kwargs["structured_outputs"] = StructuredOutputsParams(**so)
    return SamplingParams(**kwargs)


__all__ = ["ENGINE", "REQUEST", "VERSION", "ids_sha256", "logprobs_sha256", "params_from_json",
           "params_to_json", "parse_time", "record_time", "utc_time", "value_of"]
