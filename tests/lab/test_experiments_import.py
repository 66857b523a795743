"""Every lab module imports at HEAD on a CPU, and every script runs only through ``main()``, so
a renamed or moved detlora API breaks CI instead of the next GPU session."""

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import benchmarks

ROOT = Path(benchmarks.__file__).resolve().parent
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(ROOT)], prefix="benchmarks.")
                 if not m.ispkg)
SCRIPTS = [m for m in MODULES if m.startswith(("benchmarks.suites.", "benchmarks.experiments."))]


def test_the_lab_is_found():
    assert "benchmarks.suites.engine" in MODULES
    assert "benchmarks.harness.timing" in MODULES
    assert len([m for m in SCRIPTS if ".experiments." in m]) >= 10


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(name)


@pytest.mark.parametrize("name", [m for m in SCRIPTS if m != "benchmarks.suites.engine_variants"])
def test_script_has_a_main_behind_its_guard(name):
    module = importlib.import_module(name)
    source = inspect.getsource(module)
    assert callable(getattr(module, "main", None)) or name.endswith("cublas_workspace"), name
    assert 'if __name__ == "__main__":' in source, name


@pytest.mark.parametrize("name", [m for m in SCRIPTS if m.startswith("benchmarks.suites.")
                                  and m.rsplit(".", 1)[1] not in ("engine_variants",
                                                                  "cublas_workspace")])
def test_suite_help_runs_without_a_gpu(name, capsys):
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert "--out" in capsys.readouterr().out

