"""The what-if simulator as the API shows it: a run's outcome per policy with its timeline, and a run as
a background job (``/api/v1/simulate``, ``/api/v1/simulations``). Part of :mod:`controlplane.views`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class SimTimeline:
    at: tuple[float, ...]
    load_rps: tuple[float, ...]
    replicas: tuple[int, ...]
    ready: tuple[int, ...]
    ttft_p95_s: tuple[float | None, ...]


@dataclass(slots=True, frozen=True)
class PolicyOutcome:
    policy: str
    num_requests: int
    slo_attainment: float  # 0..1
    replica_seconds: float
    scale_events: int
    reversals: int
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    unfinished: int
    duration_s: float
    wall_s: float
    timeline: SimTimeline
    missed_ttft: int | None = None  # requests past the TTFT SLO (None: a control plane that does not say)
    missed_tpot: int | None = None  # past the TPOT SLO (a request may miss both)
    worst_window_attainment: float | None = None  # the lowest over 5-minute windows of arrivals


@dataclass(slots=True, frozen=True)
class SimSlo:
    ttft_s: float
    tpot_s: float


@dataclass(slots=True, frozen=True)
class SimulationResult:
    trace: str
    num_requests: int
    profile: str  # the replica profile's source
    slo: SimSlo
    policies: tuple[PolicyOutcome, ...]
    profile_path: str = "shipped"  # the file the profile came from (results recorded before: unknown)
    profile_fit: str = ""  # its fit error on calibration and held-out points


@dataclass(slots=True, frozen=True)
class SimulationProgress:
    fraction: float  # of all policies' runs
    policy: str  # simulated now


@dataclass(slots=True, frozen=True)
class SimulationJob:
    id: int
    status: str  # running | done | error | interrupted
    trace: str
    policies: tuple[str, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    actor: str = ""
    started_at: float | None = None
    finished_at: float | None = None
    progress: SimulationProgress | None = None
    result: SimulationResult | None = None
    error: str | None = None
