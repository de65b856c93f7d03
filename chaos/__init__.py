"""Faults with guaranteed revert, Chaos Toolkit-format experiments and RTO/RPO drills.

Sits between the control plane and the inference replicas: it may import ``inference`` but never
``controlplane`` or ``dashboards``.
"""

from __future__ import annotations

from typing import Any


def discover(discover_system: bool = True) -> dict[str, Any]:
    """Chaos Toolkit's entry point: ``chaos discover --no-install llm-sre-controlplane`` imports this
    distribution's first top-level package (this one) and calls its ``discover``; the actions and probes
    are :mod:`chaos.ctk`'s (imported only then, so ``import chaos`` stays light)."""
    from chaos.ctk import discover as discover_ctk

    return discover_ctk(discover_system)
