"""Model versions and canary releases as the API answers them (``/api/v1/versions``, ``/api/v1/rollouts``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class ModelVersionView:
    name: str
    model: str
    created: float
    notes: str = ""
    last_analysis: Mapping[str, Any] | None = None


@dataclass(slots=True, frozen=True)
class VersionsView:
    current: str | None
    versions: tuple[ModelVersionView, ...] = ()


@dataclass(slots=True, frozen=True)
class ReleaseView:
    """One release; each step record holds its share, window, analysis (both sides' figures) and decision."""

    id: int
    version: str
    from_version: str
    kind: str
    started: float
    outcome: str  # running | paused | promoted | aborted
    ended: float | None = None
    steps: tuple[Mapping[str, Any], ...] = ()
    reason: str = ""

    @property
    def analyses(self) -> list[Mapping[str, Any]]:
        return [s for s in self.steps if s.get("event") == "analysis"]


@dataclass(slots=True, frozen=True)
class RolloutsView:
    current: str | None
    plan: Mapping[str, Any] = field(default_factory=dict)  # {"split": {version: share}, "colours": {...}}
    release: ReleaseView | None = None
    history: tuple[ReleaseView, ...] = ()
