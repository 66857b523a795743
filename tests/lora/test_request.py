"""LoRARequest: the contract's fields and vLLM's spellings."""

from __future__ import annotations

from pathlib import Path

import pytest

from detlora.lora import LoRARequest


def test_positional_keywords_and_vllm_aliases_agree():
    a = LoRARequest("tox", 1, "/adapters/tox")
    b = LoRARequest(name="tox", id=1, path=Path("/adapters/tox"))
    c = LoRARequest(lora_name="tox", lora_int_id=1, lora_path="/adapters/tox")
    assert a == b == c and hash(a) == hash(c)
    assert (c.name, c.id, c.path) == ("tox", 1, "/adapters/tox")
    assert (a.lora_name, a.lora_int_id, a.lora_path) == ("tox", 1, "/adapters/tox")


def test_hash_is_the_ids_and_sets_still_tell_requests_apart():
    a = LoRARequest("tox", 1, "/adapters/tox")
    renamed = LoRARequest("other", 1, "/adapters/tox")
    assert hash(a) == hash(renamed) == hash(1) and a != renamed
    assert len({a, renamed, LoRARequest("tox", 1, "/adapters/tox")}) == 2


def test_frozen():
    with pytest.raises(AttributeError):
        LoRARequest("tox", 1, "/x").id = 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="a", id=0, path="/x"), r"id \(lora_int_id\) must be a positive int"),
    (dict(name="a", id=True, path="/x"), "must be a positive int"),
    (dict(name="a", id="1", path="/x"), "must be a positive int"),
    (dict(name="", id=1, path="/x"), "name must be a non-empty string"),
    (dict(name="a", id=1, path=""), "path must be a non-empty path"),
    (dict(name="a", id=1), "path must be a non-empty path"),
    (dict(name="a", id=1, path="/x", lora_int_id=2), "give id once"),
])
def test_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(**kwargs)
