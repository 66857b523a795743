"""ops/pdl.py on the CPU: PDL is off outside ``pdl_launches``, nests, restores after an
exception, and never applies to CPU tensors (the interpreter)."""

import pytest
import torch

from detlora.ops import pdl


def test_pdl_launches_nests_and_restores_after_an_exception():
    assert pdl._scopes == 0
    with pdl.pdl_launches():
        with pdl.pdl_launches():
            assert pdl._scopes == 2
        assert pdl._scopes == 1
        with pytest.raises(RuntimeError, match="boom"), pdl.pdl_launches():
            raise RuntimeError("boom")
        assert pdl._scopes == 1
    assert pdl._scopes == 0


def test_cpu_tensors_never_launch_with_pdl():
    x = torch.zeros(1)
    with pdl.pdl_launches():
        assert pdl.pdl_kwargs(x) == {"PDL": False, "launch_pdl": False}
    assert not pdl.pdl_launch(x)
