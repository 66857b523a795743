"""What every lab script shares: results metadata, results files with their history rows, and
CUDA-graph timing (``benchmarks.harness.timing``, imported on its own: it needs torch)."""

from benchmarks.harness.history import append_history, history_row, read_history
from benchmarks.harness.meta import commit_id, environment, results_meta
from benchmarks.harness.results import write_results

__all__ = ["append_history", "commit_id", "environment", "history_row", "read_history",
           "results_meta", "write_results"]
