"""The engine suite's workload puts a batch on its first adapter, or spreads its rows over
every adapter (row k on adapter k % n) for the profile of a many-adapter step."""

from benchmarks.suites.engine import BenchPlan, Workload


class _Recorder:
    def generate(self, prompts, params, loras, use_tqdm):
        self.loras = loras
        return []


def test_rows_go_to_the_first_adapter_or_spread_over_all():
    w = Workload(BenchPlan(), ["a", "b", "c"])
    llm = _Recorder()
    w.generate(llm, range(5))
    assert llm.loras == ["a"] * 5
    w.spread = True
    w.generate(llm, range(5))
    assert llm.loras == ["a", "b", "c", "a", "b"]
    w.generate(llm, range(2), loras=["c", "c"])  # an explicit list wins
    assert llm.loras == ["c", "c"]
    assert Workload(BenchPlan(), []).generate(llm, range(2)) == [] and llm.loras is None
