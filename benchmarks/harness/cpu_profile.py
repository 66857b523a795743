"""Run a module under cProfile timed by this thread's CPU clock (``time.thread_time``), not the
wall: on a busy host a wall-clock profile charges a function for the time the process waited
to be scheduled (a pipe write that woke another process, say), which says nothing of its cost.

    python -m benchmarks.harness.cpu_profile OUT.prof -m detlora.entrypoints.cli serve ...
"""

from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit("usage: python -m benchmarks.harness.cpu_profile OUT.prof -m MODULE "
                         "[ARGS...]")
    out, module, rest = argv[0], argv[2], argv[3:]
    sys.argv = [module, *rest]
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        prof.disable()
        prof.dump_stats(out)


if __name__ == "__main__":
    main(sys.argv[1:])
