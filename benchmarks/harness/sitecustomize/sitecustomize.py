"""Imported by Python at start-up in every process whose PYTHONPATH holds this folder (the
serving suite's server, front end and engine process): records Triton compilations when
DETLORA_COMPILE_LOG is set (``benchmarks.harness.compile_events``) and the engine process's loop
when DETLORA_ENGINE_TRACE is set (``benchmarks.harness.engine_trace``), and stubs the engine
process's model when DETLORA_STUB_MODEL is set (``benchmarks.harness.stub_model``); the
repository root must be on PYTHONPATH too. Then runs the interpreter's own sitecustomize, if
any, which this one shadows."""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("DETLORA_COMPILE_LOG"):
    from benchmarks.harness.compile_events import install_from_env

    install_from_env()
if os.environ.get("DETLORA_ENGINE_TRACE"):
    from benchmarks.harness import engine_trace

    engine_trace.install_from_env()
if os.environ.get("DETLORA_STUB_MODEL"):
    from benchmarks.harness import stub_model

    stub_model.install_from_env()

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
