"""docs/tensor_parallel.md's table of real architectures is what the engine's rule computes
from their config.json fields (``python -m benchmarks.tp_table --write`` refreshes it)."""

from benchmarks import tp_table
from detlora.distributed.tp_sizes import TensorParallelDims, invariant_sizes


def test_the_docs_table_is_the_rules_output():
    text = tp_table.DOC.read_text()
    inside = text.split(tp_table.BEGIN, 1)[1].split(tp_table.END, 1)[0]
    assert inside == "\n" + tp_table.table(), "run: python -m benchmarks.tp_table --write"


def test_the_table_covers_the_issue_architectures_with_their_limits():
    keep = {name: invariant_sizes(TensorParallelDims.from_config(cfg))
            for name, _, cfg in tp_table.CONFIGS}
    assert len(keep) == 27
    assert keep["SmolLM2 135M"] == (1,)  # 9 heads
    assert keep["Qwen2.5 0.5B"] == (1, 2) and keep["Qwen2.5 7B"] == (1, 2, 4)
    assert keep["Gemma 3 1B"] == (1, 2, 4) and keep["Llama 3.1 8B"] == (1, 2, 4, 8)
    assert keep["Nemotron-H 4B"] == (1, 2, 4, 8)
