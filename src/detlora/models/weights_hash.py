"""Content hashes of weights: what a fingerprint needs to know about a checkpoint.

A tensor's digest covers its dtype, shape and bytes; a set of named tensors hashes to the
digest of its sorted (name, digest) list, so shard layout and file order never matter.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch


def tensor_digest(t: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(f"{str(t.dtype).replace('torch.', '')}{tuple(t.shape)}".encode())
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def combine_digests(digests: Mapping[str, str], meta: Mapping[str, Any] | None = None) -> str:
    """One hash for named digests plus JSON metadata (e.g. a model spec or an adapter scale)."""
    h = hashlib.sha256()
    if meta is not None:
        h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for name in sorted(digests):
        h.update(f"\n{name}:{digests[name]}".encode())
    return h.hexdigest()
