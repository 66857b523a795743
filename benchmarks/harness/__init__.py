"""What every lab script shares: results metadata, results files and CUDA-graph timing."""

from benchmarks.harness.meta import commit_id, environment, results_meta
from benchmarks.harness.results import write_results

__all__ = ["commit_id", "environment", "results_meta", "write_results"]
