"""The shipped drill scenarios, by id: what each one breaks, under what load, and what it must meet.

A :class:`Scenario` is a frozen value: the fault steps (or the rolling update) to start at t0, the load to
run around them, the SLO that says when service is back, and the targets the verdict is judged against.
:func:`scenario` looks one up by id and :meth:`Scenario.with_overrides` returns a copy with the caller's
load and target overrides checked (a ValueError names the field). ``chaos.drills`` runs them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Action = Literal["fault", "rollout"]
# How the fault reaches the client: a process dies (connections reset at once), a replica stops answering
# (only a stall timeout notices), or a replica keeps serving, degraded.
Detection = Literal["reset", "stall", "degraded", "none"]


@dataclass(slots=True, frozen=True)
class SloTarget:
    """Service is back once the P99 time-to-token and the error rate stay under these for ``windows``
    consecutive windows of ``window_s`` seconds."""

    ttft_p99_s: float = 2.0
    error_rate: float = 0.0
    window_s: float = 1.0
    windows: int = 3

    def __post_init__(self) -> None:
        _positive(ttft_p99_s=self.ttft_p99_s, window_s=self.window_s)
        if not 0 <= self.error_rate <= 1:
            raise ValueError(f"slo.error_rate: must be in [0, 1], got {self.error_rate!r}")
        if self.windows < 1:
            raise ValueError(f"slo.windows: must be >= 1, got {self.windows!r}")


@dataclass(slots=True, frozen=True)
class Targets:
    """What a drill must meet to pass; None: not judged."""

    rto_service_s: float | None = None
    rto_slo_s: float | None = None
    rto_capacity_s: float | None = None
    max_failed_requests: int | None = 0
    max_tokens_lost: int | None = 0
    max_tokens_duplicated: int | None = 0
    max_writes_lost: int | None = 0


@dataclass(slots=True, frozen=True)
class FaultStep:
    """One fault injected at t0. ``zone="first"`` aims at every replica of the first zone that has one."""

    kind: str
    selector: str = "COUNT(1)"
    params: Mapping[str, float | int | str | bool] = field(default_factory=dict)
    duration_s: float = 5.0
    zone: str | None = None
    allow_all: bool = False


@dataclass(slots=True, frozen=True)
class Scenario:
    id: str
    title: str
    description: str
    detection: Detection
    faults: tuple[FaultStep, ...] = ()
    action: Action = "fault"
    rate: float = 4.0  # requests per second (Poisson)
    duration_s: float = 14.0  # load duration
    fault_at_s: float = 4.0  # t0, seconds into the load
    max_tokens: int = 24
    input_len: int = 32
    capacity_deadline_s: float = 90.0  # observation ends at t0 + this at the latest
    slo: SloTarget = field(default_factory=SloTarget)
    targets: Targets = field(default_factory=Targets)
    fleet_repairs: bool = True  # the fleet restarts what the fault took (else capacity returns at revert)

    def __post_init__(self) -> None:
        _positive(rate=self.rate, duration_s=self.duration_s, capacity_deadline_s=self.capacity_deadline_s)
        if not 0 < self.fault_at_s < self.duration_s:
            raise ValueError(f"fault_at_s: must be inside the load (0, {self.duration_s:g}), "
                             f"got {self.fault_at_s!r}")
        if self.max_tokens < 1 or self.input_len < 1:
            raise ValueError("max_tokens and input_len: must be >= 1")
        if self.action == "fault" and not self.faults:
            raise ValueError(f"{self.id}: a fault scenario needs at least one fault step")

    @property
    def fault_duration_s(self) -> float:
        return max((f.duration_s for f in self.faults), default=0.0)

    def with_overrides(self, overrides: Mapping[str, Any]) -> Scenario:
        """A copy with load fields (rate, duration_s, fault_at_s, max_tokens, input_len,
        capacity_deadline_s) and target fields (``targets.<name>`` or the bare name) replaced."""
        load: dict[str, Any] = {}
        targets: dict[str, Any] = {}
        target_names = {f.name for f in dataclasses.fields(Targets)}
        for name, value in overrides.items():
            if value is None:
                continue
            bare = name.removeprefix("targets.")
            if name in _LOAD_FIELDS:
                load[name] = _number(name, value)
            elif bare in target_names:
                targets[bare] = _number(name, value)
            else:
                allowed = ", ".join(sorted(_LOAD_FIELDS | target_names))
                raise ValueError(f"{name}: unknown override (allowed: {allowed})")
        for name in ("max_tokens", "input_len"):
            if name in load:
                load[name] = int(load[name])
        if targets:
            load["targets"] = dataclasses.replace(self.targets, **targets)
        return dataclasses.replace(self, **load)

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_LOAD_FIELDS = frozenset({"rate", "duration_s", "fault_at_s", "max_tokens", "input_len",
                          "capacity_deadline_s"})


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    return value


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value!r}")


_CAPACITY_S = 90.0  # restart on a busy 2-core machine: backoff + model load + first forward pass
# A replica that stops answering is found by the gateway when its open streams stall (stall timeout, 2 s
# by default); their continuations and the requests that were waiting there then start elsewhere.
_SILENT_RTO_S = 4.0

SCENARIOS: dict[str, Scenario] = {s.id: s for s in (
    Scenario("replica-crash", "Replica crash", "SIGKILL one replica under load; streams on it resume "
             "elsewhere, the fleet restarts it.", "reset",
             faults=(FaultStep("kill", duration_s=1.0),),
             targets=Targets(rto_service_s=1.0, rto_capacity_s=_CAPACITY_S)),
    Scenario("replica-hang", "Replica hang", "One replica accepts requests and emits nothing; the gateway's "
             "stall timeout moves its streams, the fleet marks it unready.", "stall",
             faults=(FaultStep("hang", duration_s=6.0),), fleet_repairs=False,
             targets=Targets(rto_service_s=_SILENT_RTO_S, rto_capacity_s=30.0)),
    Scenario("zone-outage", "Zone outage", "Every replica of one zone is killed at once.", "reset",
             faults=(FaultStep("kill", selector="ALL", zone="first", duration_s=1.0),),
             targets=Targets(rto_service_s=1.0, rto_capacity_s=_CAPACITY_S)),
    Scenario("link-partition", "Link partition", "TCP to one replica's port is dropped on loopback (eBPF); "
             "open streams stall and resume elsewhere.", "stall",
             faults=(FaultStep("partition", duration_s=6.0),), fleet_repairs=False,
             targets=Targets(rto_service_s=_SILENT_RTO_S, rto_capacity_s=30.0)),
    Scenario("device-failure", "Device failure", "One replica's accelerator fails: in-flight requests "
             "error, readiness answers 503.", "reset",
             faults=(FaultStep("device_failure", duration_s=6.0),), fleet_repairs=False,
             targets=Targets(rto_service_s=1.0, rto_capacity_s=30.0)),
    Scenario("kv-pressure", "KV cache pressure", "90% of one replica's KV blocks are held back: it "
             "preempts and queues, and must not lose a request.", "degraded",
             faults=(FaultStep("kv_pressure", params={"fraction": 0.9}, duration_s=6.0),),
             fleet_repairs=False, targets=Targets(rto_service_s=5.0, rto_capacity_s=30.0)),
    Scenario("rolling-update", "Rolling update under load", "Every replica is replaced, one at a time, "
             "by one of a new model folder (the same weights), with readiness gates.", "none",
             action="rollout", duration_s=16.0, capacity_deadline_s=240.0,
             targets=Targets(rto_service_s=1.0, rto_capacity_s=240.0)),
)}


def scenario(scenario_id: str) -> Scenario:
    """The shipped scenario ``scenario_id``; KeyError naming the known ones."""
    try:
        return SCENARIOS[scenario_id]
    except KeyError:
        raise KeyError(f"scenario: unknown {scenario_id!r} (known: {', '.join(SCENARIOS)})") from None
