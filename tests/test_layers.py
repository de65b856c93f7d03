"""The layers hold: packages and controlplane's sub-packages import only downwards, with no cycle.

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``) and ``lint-imports`` checks them. The
engine's bookkeeping modules import no torch, so batching and KV accounting run and test anywhere.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inference", "chaos", "controlplane", "dashboards")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
TORCH_FREE = ("inference/sequence.py", "inference/kv_blocks.py", "inference/scheduler.py",
              "inference/sampling_params.py", "inference/config.py", "inference/output.py")


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_every_import_contract_is_kept() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "broken"), [
    ("controlplane/gateway/routing.py", "from controlplane.api import factory", "import downwards"),
    ("controlplane/errors.py", "from controlplane.store import database", "import downwards"),
    ("chaos/targets.py", "from controlplane import replicas", "Packages import downwards"),
    ("controlplane/sim/fleet.py", "from controlplane.autoscale import loop", "not the live loop"),
    ("dashboards/figures.py", "from controlplane.store import database", "typed client only"),
    ("chaos/drill_figures.py", "from chaos import drills", "No import cycle"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert f"{broken}" in result.stdout.split("Broken contracts", 1)[1], result.stdout


@pytest.mark.parametrize("module", TORCH_FREE)
def test_bookkeeping_module_imports_no_torch(module: str) -> None:
    assert "torch" not in imported_packages(ROOT / module)
