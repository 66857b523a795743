"""The first-start notice: a marker in Triton's cache per (code, versions, GPU, model,
level), absent until an engine has built its kernels."""

from __future__ import annotations

import torch

from detlora.engine.runner import kernel_cache


def test_the_marker_follows_the_key_and_lives_in_tritons_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    import triton

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton"), raising=False)
    spec = {"hidden_size": 576, "num_layers": 30}
    key = kernel_cache.kernel_key(spec, torch.bfloat16, torch.device("cpu"), "batch_invariant", 1)
    assert kernel_cache.triton_cache_dir() == tmp_path / "triton"
    assert not kernel_cache.kernels_cached(key)
    kernel_cache.mark_kernels_cached(key, 12.34)
    assert kernel_cache.kernels_cached(key)
    assert kernel_cache.kernel_cache_marker(key).parent.parent == tmp_path / "triton"
    # Another model shape or level compiles other kernels: not cached.
    for other in (kernel_cache.kernel_key({**spec, "hidden_size": 1024}, torch.bfloat16,
                                          torch.device("cpu"), "batch_invariant", 1),
                  kernel_cache.kernel_key(spec, torch.bfloat16, torch.device("cpu"), "fast", 1)):
        assert not kernel_cache.kernels_cached(other)


def test_a_read_only_cache_only_means_no_marker(tmp_path, monkeypatch):
    import triton

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setattr(triton.knobs.cache, "dir", str(blocked), raising=False)
    key = {"k": 1}
    kernel_cache.mark_kernels_cached(key, 1.0)  # no error
    assert not kernel_cache.kernels_cached(key)
