"""suites.architectures on the CPU: the registry's configs are ones the engine reads, the smoke
mode runs a shape end to end into rows of the results schema, and earlier rows are kept."""

import json
from dataclasses import replace

import pytest

from benchmarks.harness.headlines import headline
from benchmarks.suites import architectures as arch

ROW_KEYS = {"model", "family", "level", "tpot_b1_ms", "roofline_b1", "tok_s_b64",
            "bi_vs_fast_b1", "bi_vs_fast_b64", "differing", "comparisons"}


@pytest.mark.parametrize("name", list(arch.SHAPES))
def test_registered_shapes_are_read_by_the_engine(name):
    from detlora.models.spec import ModelSpec

    shape = arch.SHAPES[name]
    for cfg in (shape.config, arch.smoke_config(shape.config)):
        spec = ModelSpec.from_config(cfg)
        assert spec.architecture == cfg["architectures"][0]
        assert spec.layer_windows == () or min(w for w in spec.layer_windows if w) >= \
            spec.max_position_embeddings  # no window the engine would refuse


def test_smoke_run_gives_schema_rows(tmp_path):
    plan = replace(arch.Plan.smoke_plan(), prompts=3, output_len=3, cross_batches=(1,),
                   batch1_prompts=1, throughput_batches=(1, 2))
    result = arch.run(["phi3.5-mini"], plan, log=lambda _: None)
    rows = result["rows"]
    assert [r["level"] for r in rows] == ["fast", "batch_invariant"]
    assert all(set(r) == ROW_KEYS for r in rows)
    bi = rows[1]
    assert bi["family"] == "phi3" and bi["differing"] == 0 and bi["comparisons"] >= 8
    assert bi["bi_vs_fast_b1"] == bi["tpot_b1_ms"] / rows[0]["tpot_b1_ms"]
    details = result["meta"]["models"]["phi3.5-mini"]
    assert details["step_bytes_b1"] > 0 and details["adapter_bytes"] > 0
    assert headline({**result, "meta": {}})["differing"]["phi3.5-mini_batch_invariant"] == \
        f"0/{bi['comparisons']}"
    # A later run of another model keeps these rows.
    earlier = tmp_path / "architectures.json"
    earlier.write_text(json.dumps(result))
    later = {"meta": {"models": {}}, "rows": [dict(rows[0], model="mistral-7b")]}
    merged = arch.keep_rows_from(later, earlier)
    assert [r["model"] for r in merged["rows"]] == ["phi3.5-mini"] * 2 + ["mistral-7b"]
    assert "phi3.5-mini" in merged["meta"]["models"]


def test_help_and_bad_models(capsys):
    with pytest.raises(SystemExit) as e:
        arch.main(["--help"])
    assert e.value.code == 0 and "--models" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        arch.main(["--models", "nope"])
