"""One id names one adapter directory, whatever the spelling of its path: a trailing slash,
``..``, a relative path or a symlink name the same directory as its resolved real path. A
different directory under the same id is refused, and content changes are still caught."""

from __future__ import annotations

import os
import shutil

import pytest
from tests.helpers.adapter_files import write_adapter

from detlora.lora.manager import LoRAManager
from detlora.lora.request import LoRARequest


def test_spellings_of_one_directory_are_one_adapter(model, tmp_path, monkeypatch):
    real = write_adapter(tmp_path / "adapters" / "tox", seed=1)
    link = tmp_path / "latest"
    link.symlink_to(real, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    spellings = [str(real), f"{real}/", str(link), f"{link}/",
                 str(tmp_path / "adapters" / ".." / "adapters" / "tox"), "adapters/tox",
                 "./latest"]
    m = LoRAManager(model)
    slots = m.activate([LoRARequest("tox", 1, p) for p in spellings])  # one step
    assert len(set(slots)) == 1 and m.loads == 1
    for p in spellings:  # and across steps
        assert m.add(LoRARequest("tox", 1, p)) == slots[0]
    assert m.loads == 1
    assert LoRARequest("tox", 1, f"{link}/").real_path == os.path.realpath(real)


def test_another_directory_under_the_id_is_still_refused(model, tmp_path):
    a = write_adapter(tmp_path / "a", seed=1)
    b = tmp_path / "b"
    shutil.copytree(a, b)  # the same bytes elsewhere: another adapter all the same
    m = LoRAManager(model)
    m.add(LoRARequest("a", 1, str(a)))
    with pytest.raises(ValueError, match=r"adapter id 1 was first used for .*a.*, now for "
                                         r".*b.*: one id must name one adapter"):
        m.add(LoRARequest("a", 1, str(b)))


def test_a_symlink_pointed_elsewhere_is_another_adapter(model, tmp_path):
    a = write_adapter(tmp_path / "a", seed=1)
    b = write_adapter(tmp_path / "b", seed=2)
    link = tmp_path / "current"
    link.symlink_to(a)
    m = LoRAManager(model)
    m.add(LoRARequest("cur", 1, str(link)))
    link.unlink()
    link.symlink_to(b)
    with pytest.raises(ValueError, match="one id must name one adapter"):
        m.add(LoRARequest("cur", 1, str(link)))


def test_content_changes_are_still_detected_through_a_symlink(model, tmp_path):
    a = write_adapter(tmp_path / "a", seed=1, r=4)
    link = tmp_path / "link"
    link.symlink_to(a)
    others = [LoRARequest(f"o{i}", 10 + i, str(write_adapter(tmp_path / f"o{i}", seed=5 + i)))
              for i in range(2)]
    m = LoRAManager(model, max_cpu_loras=2)
    m.add(LoRARequest("a", 1, str(link)))
    m.activate(others)  # evicts it, from its slot and from the host cache
    write_adapter(a, seed=99, r=4)  # new weights in place
    with pytest.raises(ValueError, match="changed on disk"):
        m.add(LoRARequest("a", 1, f"{a}/"))
