"""LoRARegistry: adapters registered by path, before any is read."""

from __future__ import annotations

import pytest
from tests.helpers.adapter_files import write_adapter

from detlora.lora.registry import LoRARegistry
from detlora.lora.request import LoRARequest


def test_register_without_reading(tmp_path):
    reg = LoRARegistry()
    (tmp_path / "empty").mkdir()  # no files yet: registering reads nothing
    a = LoRARequest("a", 1, str(tmp_path / "empty"))
    assert reg.register(a) is a and 1 in reg and len(reg) == 1
    assert reg.register(LoRARequest("a", 1, str(tmp_path / "empty"))) is a  # idempotent
    assert reg.get(1) is a and reg.get(2) is None and reg.requests() == [a]


def test_register_refusals(tmp_path):
    reg = LoRARegistry()
    p1 = write_adapter(tmp_path / "p1")
    p2 = write_adapter(tmp_path / "p2")
    with pytest.raises(FileNotFoundError, match=r"adapter directory .*nope does not exist"):
        reg.register(LoRARequest("a", 1, str(tmp_path / "nope")))
    with pytest.raises(TypeError, match="expected a LoRARequest, got str"):
        reg.register("a")
    reg.register(LoRARequest("a", 1, str(p1)))
    with pytest.raises(ValueError, match="one id must name one adapter"):
        reg.register(LoRARequest("a", 1, str(p2)))
    with pytest.raises(ValueError, match="name 'a' is registered for id 1"):
        reg.register(LoRARequest("a", 2, str(p2)))
    with pytest.raises(ValueError, match="one id must name one adapter"):
        reg.check(LoRARequest("b", 1, str(p2)))
    assert reg.remove(1) and not reg.remove(1)
    reg.register(LoRARequest("a", 1, str(p2)))  # free again after remove
    assert reg.get(1).path == str(p2)


def test_note_loaded_registers_unknown_ids(tmp_path):
    reg = LoRARegistry()
    r = LoRARequest("x", 3, str(write_adapter(tmp_path / "x")))
    reg.note_loaded(r)
    assert reg.requests() == [r]
    with pytest.raises(ValueError, match="one id must name one adapter"):
        reg.note_loaded(LoRARequest("x", 3, str(tmp_path)))
