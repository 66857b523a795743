"""The Nemotron-3-Nano-4B shape of benchmarks/suites/architectures_nemotron.py: its config is
the 4B's (3,973,556,832 parameters, 21 Mamba / 4 attention / 17 MLP layers), and the roofline
counts its KV (attention layers only) and its Mamba states."""

import math

import torch

from benchmarks.suites.architectures_nemotron import (
    SHAPES,
    kv_bytes_per_token,
    state_bytes_per_seq,
)
from detlora.layers.backend import make_backend
from detlora.models.nemotron_h import NemotronHForCausalLM
from detlora.models.spec import ModelSpec


def test_the_4b_shape_and_its_roofline_bytes():
    cfg = SHAPES["nemotron-3-nano-4b"].config
    spec = ModelSpec.from_config(cfg)
    assert spec.hybrid is not None
    assert [spec.hybrid.layer_types.count(k) for k in "M*-"] == [21, 4, 17]
    model = NemotronHForCausalLM(spec, backend=make_backend("cpu"), dtype=torch.bfloat16,
                                 device="meta")
    assert sum(math.prod(shape) for shape, _ in model.hf_weights().values()) == 3_973_556_832
    assert kv_bytes_per_token(cfg) == spec.kv_cache_bytes_per_token(torch.bfloat16) == 16384
    ssm = 96 * 80 * 128 * 4  # 3.75 MiB per layer, fp32
    conv = 3 * (7680 + 2 * 8 * 128) * 2
    assert state_bytes_per_seq(cfg)["roofline"] == 21 * 2 * (ssm + conv)
    # What the engine holds per sequence: conv state, SSM state, the open chunk's rows.
    rows = 256 * (7680 + 2 * 8 * 128 + 96) * 2
    assert model.state_bytes_per_slot() == 21 * (conv + ssm + rows)
