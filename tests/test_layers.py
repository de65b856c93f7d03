"""The package layers only import downwards: dashboards -> controlplane -> chaos -> inference.

``inference`` imports none of the others, ``chaos`` never imports ``controlplane`` or ``dashboards``, and
the engine's bookkeeping modules import no torch (so they run and test anywhere).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "inference": {"chaos", "controlplane", "dashboards"},
    "chaos": {"controlplane", "dashboards"},
    "controlplane": {"dashboards"},
}
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


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_lower_layers(package: str) -> None:
    offenders = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & FORBIDDEN[package])
                 for p in (ROOT / package).rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("module", TORCH_FREE)
def test_bookkeeping_module_imports_no_torch(module: str) -> None:
    assert "torch" not in imported_packages(ROOT / module)
