"""Every third-party package the product imports is declared in ``pyproject.toml``, so that a fresh
``pip install .`` runs it (a package that only arrives with another one's dependencies may leave)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("inference", "chaos", "controlplane", "dashboards")
# Scripts that run under another environment's interpreter, never imported in this one: their imports are
# that environment's, not the project's dependencies.
OTHER_ENVIRONMENTS = {
    "inference/bench/vllm_child.py": "vLLM's CPU build, in .venv-vllm (make bench-vllm): "
                                     "python -m inference.bench offline --vs-vllm runs it there",
}


def imported_modules() -> dict[str, str]:
    """Top-level third-party module -> the first file that imports it."""
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if str(path.relative_to(ROOT)) in OTHER_ENVIRONMENTS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top not in PACKAGES and top not in sys.stdlib_module_names and top != "__future__":
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def normalized(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {normalized(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    return {normalized(r) for r in project["dependencies"]}, extras


def test_every_third_party_import_is_a_declared_dependency() -> None:
    required, extras = declared()
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for module, where in imported_modules().items():
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not names & (required | extras):
            undeclared[module] = where
    assert undeclared == {}, f"imported but not in pyproject.toml's dependencies: {undeclared}"


def test_scripts_of_other_environments_are_run_by_path_never_imported() -> None:
    for script in OTHER_ENVIRONMENTS:
        module = script.removesuffix(".py").replace("/", ".")
        importers = [str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                     if module in p.read_text() or f"import {module.rpartition('.')[2]}" in p.read_text()]
        assert importers == [], f"{script} runs in another environment; imported by {importers}"
        assert (ROOT / script).is_file()


def test_only_the_offline_benchmark_the_ray_backend_and_chaos_discover_need_an_extra() -> None:
    """transformers (dev) is the offline benchmark's reference, imported where that benchmark runs; ray
    (the ``ray`` extra) is imported only when ``[fleet] backend = "ray"`` joins a cluster; chaoslib (dev, with
    Chaos Toolkit) only by ``chaos discover`` and to check an experiment with chaoslib's own validator too."""
    required, _ = declared()
    distributions = importlib.metadata.packages_distributions()
    optional = {m for m in imported_modules()
                if not {d.lower().replace("_", "-") for d in distributions.get(m, [m])} & required}
    assert optional == {"transformers", "ray", "chaoslib"}
