"""Chaos as the API shows it: the fault catalogue, active faults, an injection's blast radius, reverts,
the halt, and Chaos Toolkit experiments with their journals (``/api/v1/chaos/*``). Part of
:mod:`controlplane.views`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.views.decoder import DOCUMENT, Scalar


@dataclass(slots=True, frozen=True)
class FaultParam:
    name: str
    type: str  # number | integer | string
    description: str
    required: bool = True
    default: Scalar = None


@dataclass(slots=True, frozen=True)
class FaultKind:
    """A kind of the catalogue; an unavailable one says why."""

    kind: str
    family: str
    description: str
    params: tuple[FaultParam, ...] = ()
    takes_down: bool = False
    available: bool = True
    unavailable_reason: str | None = None


@dataclass(slots=True, frozen=True)
class ActiveFault:
    id: int | None  # None: it never went in (see error)
    kind: str
    target: str
    remaining_s: float
    error: str | None = None


@dataclass(slots=True, frozen=True)
class BlastRadius:
    """What an injection would hit, and why the safety limits would refuse it."""

    kind: str
    duration_s: float
    targets: tuple[str, ...]
    reasons: tuple[str, ...]
    allowed: bool


@dataclass(slots=True, frozen=True)
class Injection:
    dry_run: bool
    plan: BlastRadius
    faults: tuple[ActiveFault, ...] = ()


@dataclass(slots=True, frozen=True)
class Revert:
    fault_id: int
    ok: bool
    detail: str = ""
    retryable: bool = False


@dataclass(slots=True, frozen=True)
class Halt:
    reverted: tuple[int, ...]
    failed: Mapping[str, str]  # fault id -> why its revert failed
    elapsed_s: float
    halted: bool


@dataclass(slots=True, frozen=True)
class HaltState:
    halted: bool  # True: new faults are refused until a release


@dataclass(slots=True, frozen=True)
class ExperimentStarted:
    id: int
    status: str
    journal: Mapping[str, Any] | None = None  # a dry run's journal, at once


@dataclass(slots=True, frozen=True)
class ExperimentSummary:
    id: int
    title: str | None = None
    status: str | None = None
    deviated: bool | None = None
    dry: bool | None = None
    start: str | None = None
    end: str | None = None
    duration: float | None = None
    by: str | None = None
    stop_condition: Mapping[str, Any] | None = None
    fault_ids: tuple[int, ...] | None = None


@dataclass(slots=True, frozen=True)
class Experiment:
    """An experiment's record; ``journal`` is its whole Chaos Toolkit-format journal (``run``,
    ``rollbacks``, ``steady_states``... ``status`` is "running" until it ends)."""

    id: int
    status: str
    title: str = ""
    by: str | None = None
    journal: Mapping[str, Any] = field(default_factory=dict, metadata=DOCUMENT)
