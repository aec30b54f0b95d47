"""The contracts of the code base that CI holds: the core is a stack (import-linter's
contracts in pyproject.toml), the package type-checks (mypy, settings in pyproject.toml),
and every flat algorithm name has code (checked when mpistrat.dispatch is imported)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: it comes with mpistrat's test extra "
                    f"(pip install -e '.[test]'; bin/test does)")
    return found


def test_no_import_runs_up_the_layers():
    result = subprocess.run([_tool("lint-imports"), "--config", "pyproject.toml"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    # (counted in the text: tomllib is Python 3.11+, and the package supports 3.10)
    kept = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {kept} kept, 0 broken." in result.stdout, result.stdout[-3000:]


@pytest.mark.timeout(600)
def test_the_package_type_checks():
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT,
                            capture_output=True, text=True, timeout=590, check=False)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-3000:]


def test_the_old_module_paths_of_the_runtime_still_import():
    """``mpistrat.topology`` and its neighbours moved into ``mpistrat.runtime``; a script
    importing them by the old names gets the same module objects (in a fresh process, so
    nothing else has imported them first)."""
    code = (
        "import importlib\n"
        "import mpistrat.topology, mpistrat.devices, mpistrat.shared\n"
        "from mpistrat import _agreement, _stall\n"
        "from mpistrat.topology import get_topology\n"
        "pairs = {'topology': 'topology', 'devices': 'devices', 'shared': 'shared',\n"
        "         '_agreement': 'agreement', '_stall': 'stall'}\n"
        "for old, new in pairs.items():\n"
        "    assert importlib.import_module('mpistrat.' + old) is \\\n"
        "        importlib.import_module('mpistrat.runtime.' + new), old\n"
        "assert get_topology.__module__ == 'mpistrat.runtime.topology'\n"
        "import sys; assert 'mpi4py.MPI' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
