"""benchmarks.suites.architectures_gemma on the CPU: every registry shape is a config the
engine reads (E4B's layers, head sizes, KV sharing and page groups as the reference notes
give them), the bytes a decode step reads, and the random checkpoint and adapter writers,
whose output the loader and the LoRA manager take. (``--smoke`` runs every section on a tiny
Gemma 4 end to end; it takes minutes on a CPU, so CI checks these parts.)"""

import torch

from benchmarks.suites import architectures_gemma as ag
from detlora.layers.lora_slots import LoRAConfig
from detlora.lora.manager import LoRAManager
from detlora.lora.request import LoRARequest
from detlora.models.loader import load_model
from detlora.models.spec import ModelSpec


def test_registry_shapes_read_as_their_published_layouts():
    e4b = ModelSpec.from_config(ag.SHAPES["gemma4-e4b"]["config"])
    full = [i for i in range(42) if e4b.attention(i).window is None]
    assert full == [5, 11, 17, 23, 29, 35, 41]
    assert {e4b.attention(i).head_dim for i in full} == {512}
    assert e4b.attention(0).head_dim == 256 and e4b.attention(0).window == 512
    sources = {i: e4b.attention(i).kv_source for i in range(24, 42)}
    assert sources == {i: 23 if i in full else 22 for i in range(24, 42)}
    assert all(e4b.attention(i).kv_source is None for i in range(24))
    groups = e4b.kv_groups()
    assert [(g.window, len(g.layers)) for g in groups] == [(None, 4), (512, 20)]
    # 20 sliding layers x 2 KiB + 4 full x 4 KiB per token in bf16 (the notes' 40 + 16 KiB).
    assert e4b.kv_cache_bytes_per_token(torch.bfloat16) == 56 * 1024
    assert ag.full_kv_bytes_per_token(ag.GEMMA4_E4B) == 7 * 4 * 1024  # 3 consumers read too
    g1 = ModelSpec.from_config(ag.GEMMA3_1B)
    assert [i for i in range(26) if g1.attention(i).window is None] == [5, 11, 17, 23]
    assert g1.attention(0).softmax_scale == 256**-0.5 and g1.attention(0).rope.theta == 1e4
    g4 = ModelSpec.from_config(ag.GEMMA3_4B)
    assert g4.attention(5).rope.scaling["factor"] == 8.0 and g4.attention(0).window == 1024


def test_decode_bytes_count_windows_and_weights():
    small, big = (ag.decode_bytes(ag.GEMMA4_E4B, c, 0) for c in (4096, 32768))
    assert big - small == (32768 - 4096) * ag.full_kv_bytes_per_token(ag.GEMMA4_E4B)
    # Weights: every linear (no PLE table, one row of it) and the tied head, in bf16.
    assert 2 * 3.5e9 < small < 2 * 5.0e9


def test_writers_give_what_the_loader_and_the_adapter_manager_take(tmp_path):
    cfg = ag.SMOKE["config"]
    nbytes = ag.write_checkpoint(tmp_path / "m", cfg, shard_bytes=1 << 18)
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1  # sharded, with an index
    model = load_model(tmp_path / "m", lora_config=LoRAConfig(max_loras=1, max_lora_rank=4))
    assert model.weights_hash() and nbytes > 0
    ag.write_adapter(tmp_path / "a", tmp_path / "m", targets=ag.TARGETS, rank=4)
    manager = LoRAManager(model)
    manager.add(LoRARequest("a", 1, str(tmp_path / "a")))
    assert manager.resident() == [1]
