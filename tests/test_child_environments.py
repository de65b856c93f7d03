"""Every process the project spawns gets its environment from one helper that withholds the operators'
secrets (``inference.environment.child_environment``, or ``replica_environment`` built on it): a new
spawner that forgets it, and so hands ``CONTROLPLANE_ADMIN_TOKEN`` to its child, fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("inference", "chaos", "controlplane", "dashboards")
SPAWNERS = {"subprocess": {"Popen", "run", "call", "check_call", "check_output"},
            "asyncio": {"create_subprocess_exec", "create_subprocess_shell"}}
HELPERS = ("child_environment", "replica_environment", "self.environment()")
# A benchmark that starts `controlplane up` and must hand it the admin token it chose.
ON_PURPOSE = {"chaos/drill_bench.py"}


def spawns(tree: ast.AST) -> list[tuple[ast.Call, ast.AST]]:
    """(call, enclosing function or module) for each subprocess spawn."""
    found: list[tuple[ast.Call, ast.AST]] = []

    def visit(node: ast.AST, scope: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else scope
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr in SPAWNERS.get(ast.unparse(child.func.value), ()):
                found.append((child, scope))
            visit(child, inner)

    visit(tree, tree)
    return found


def test_every_spawner_builds_its_childs_environment_without_secrets() -> None:
    offenders, checked = [], 0
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            if where in ON_PURPOSE:
                continue
            for call, scope in spawns(ast.parse(path.read_text())):
                checked += 1
                env = next((k.value for k in call.keywords if k.arg == "env"), None)
                source = ast.unparse(scope)
                if env is None or not any(helper in source for helper in HELPERS):
                    offenders.append(f"{where}:{call.lineno}")
    assert checked >= 8  # replicas, stress-ng, the load client, Prometheus, promtool, the console, ...
    assert offenders == [], f"spawned without child_environment(): {offenders}"
