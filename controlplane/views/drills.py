"""Drills as the API shows them: the scenarios, a dry run's plan, a run's progress and report, and the
comparison of several (``/api/v1/drills/*``; their schedules are in
:mod:`controlplane.views.schedules`). Part of :mod:`controlplane.views`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.views.decoder import DOCUMENT, Number, Scalar


@dataclass(slots=True, frozen=True)
class ScenarioFault:
    kind: str
    selector: str = "COUNT(1)"
    params: Mapping[str, Scalar] = field(default_factory=dict)
    duration_s: float = 0.0
    zone: str | None = None
    allow_all: bool = False


@dataclass(slots=True, frozen=True)
class Scenario:
    """A shipped drill scenario with its defaults; ``targets`` are the verdict's (None: not judged)."""

    id: str
    title: str
    description: str
    detection: str
    faults: tuple[ScenarioFault, ...] = ()
    action: str = "fault"
    rate: float = 0.0
    duration_s: float = 0.0
    fault_at_s: float = 0.0
    max_tokens: int = 0
    input_len: int = 0
    capacity_deadline_s: float = 0.0
    targets: Mapping[str, Number | None] = field(default_factory=dict)
    replicas: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()
    load: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Aim:
    """What a drill was asked to hit, or what it hit (``how``: why those)."""

    replicas: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()
    how: str = ""


@dataclass(slots=True, frozen=True)
class PlannedFault:
    kind: str
    selector: str
    duration_s: float
    targets: tuple[str, ...]
    allowed: bool
    reasons: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class DrillPlan:
    """A dry run: the scenario with the overrides, its load, aim and faults, the RTO predicted."""

    scenario: Scenario
    faults: tuple[PlannedFault, ...]
    targets_requested: Aim = Aim()
    targets_resolved: Aim = Aim()
    load: Mapping[str, Any] = field(default_factory=dict)
    prediction: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class DrillStarted:
    id: int
    scenario: str
    status: str


@dataclass(slots=True, frozen=True)
class DrillProgress:
    phase: str
    fraction: float


@dataclass(slots=True, frozen=True)
class DrillSummary:
    id: int
    scenario: str
    status: str  # running | passed | failed | aborted | error | interrupted
    started_at: float | None = None
    finished_at: float | None = None
    progress: DrillProgress | None = None
    error: str | None = None
    rto_service_s: float | None = None
    rto_slo_s: float | None = None
    rto_capacity_s: float | None = None
    requests_failed: int | None = None
    tokens_lost: int | None = None


@dataclass(slots=True, frozen=True)
class DrillCheck:
    name: str
    target: Number
    measured: Number | None
    ok: bool
    outcome: str = ""  # pass, fail or not measured (empty in reports stored before it was kept)


@dataclass(slots=True, frozen=True)
class DrillReport:
    """A drill's report (while it runs: what is known, and ``progress``). ``figures`` (RTO, RPO, the
    clock after t0) and ``timeline`` stay mappings: the drill figures name them; ``document`` is the whole
    report as stored (what ``drill show`` prints)."""

    id: int
    scenario: str
    status: str
    title: str = ""
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    progress: DrillProgress | None = None
    fault_targets: tuple[str, ...] = ()
    targets_requested: Aim = Aim()
    targets_resolved: Aim | None = None
    load: Mapping[str, Any] | None = None
    figures: Mapping[str, Any] = field(default_factory=dict)
    prediction: Mapping[str, Any] = field(default_factory=dict)
    checks: tuple[DrillCheck, ...] = ()
    timeline: Mapping[str, Any] = field(default_factory=dict)
    document: Mapping[str, Any] = field(default_factory=dict, metadata=DOCUMENT)


@dataclass(slots=True, frozen=True)
class ComparedDrill:
    id: int
    scenario: str
    status: str
    started_at: float | None = None


@dataclass(slots=True, frozen=True)
class ComparedFigure:
    figure: str
    label: str
    unit: str
    values: tuple[Number | None, ...]  # one per drill, None where not measured


@dataclass(slots=True, frozen=True)
class DrillComparison:
    columns: tuple[ComparedDrill, ...]
    rows: tuple[ComparedFigure, ...]


@dataclass(slots=True, frozen=True)
class DrillAbort:
    id: int
    aborting: bool
