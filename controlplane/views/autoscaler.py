"""The autoscaler as the API shows it: its status and settings, each decision with its inputs and
proposals, and the cron windows that set its bounds (``/api/v1/autoscaler/*``). Part of
:mod:`controlplane.views`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class ActiveWindow:
    name: str
    schedule: str  # the window's cron and duration, in words


@dataclass(slots=True, frozen=True)
class Proposal:
    source: str  # a metric, panic, anomaly, ...
    replicas: int
    reason: str


@dataclass(slots=True, frozen=True)
class DecisionInputs:
    current: int
    ready: int
    starting: int
    metrics: Mapping[str, float | None]
    demand: float | None = None
    request_rate: float | None = None  # what reached the replicas plus refused_rate
    panic_request_rate: float | None = None
    panic_counted_s: float | None = None  # the seconds of arrivals that rate counted (None: the whole window)
    mean_prompt_tokens: float | None = None
    mean_output_tokens: float | None = None
    prompt_tokens_sd: float | None = None
    output_tokens_sd: float | None = None
    notes: tuple[str, ...] = ()
    refused_rate: float | None = None  # refused at the gateways for want of capacity, per second
    prefix_hit_share: float | None = None  # of the prompt tokens admitted, the share prefix caches held
    # the replicas' engine time against their profile's: ratio, busy_s_per_s, predicted_s_per_s, replicas
    profile_drift: Mapping[str, Any] | None = None
    rate_window_s: float | None = None  # the seconds request_rate was measured over
    load_changed: bool = False  # request_rate was a change of load: the steady load started again from it


@dataclass(slots=True, frozen=True)
class Decision:
    """One tick of the autoscaler: what it saw, each proposal with its reason, the clamps, the outcome."""

    at: float  # POSIX seconds
    mode: str  # active | observe_only | paused
    inputs: DecisionInputs
    proposals: tuple[Proposal, ...]
    final: int
    applied: bool
    outcome: str
    tick: int = 0
    recommendation: int | None = None
    panic: bool = False
    window: ActiveWindow | None = None
    bounds: tuple[int, ...] = ()
    clamps: tuple[str, ...] = ()
    error: str | None = None
    anomaly: Mapping[str, Any] | None = None
    id: int | None = None
    ts: float | None = None


@dataclass(slots=True, frozen=True)
class AutoscalerPolicy:
    """The run-time settings of the autoscaler (its ``[autoscaler]`` configuration as changed since)."""

    enabled: bool
    observe_only: bool
    tick_s: float
    min_replicas: int
    max_replicas: int
    target_waiting_per_replica: float
    target_kv_cache_usage: float
    ttft_slo_s: float
    target_tokens_per_s_per_replica: float
    target_engine_load_per_replica: float
    tolerance: float
    scale_down_stabilization_s: float
    scale_down_period_s: float
    guards: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class AutoscalerStatus:
    mode: str  # active | observe_only | paused
    paused: bool
    observe_only: bool
    ticks: int
    desired_replicas: int
    window: ActiveWindow | None
    last_decision: Decision | None
    config: AutoscalerPolicy
    enabled: bool = True  # False: the loop never runs (autoscaler.enabled = false)
    replica_profile: str = ""
    windows_source: str = "config"  # config, or api once set through the API


@dataclass(slots=True, frozen=True)
class ScheduleWindow:
    """A cron window that sets the replica bounds while active, with its next start and end (POSIX s)."""

    name: str
    cron: str
    schedule: str
    active: bool
    next_start: float | None
    next_end: float | None
    duration_s: float = 0.0
    end_cron: str = ""
    timezone: str = "UTC"
    weekdays: tuple[str, ...] = ()
    min_replicas: int | None = None
    max_replicas: int | None = None

    def settings(self) -> dict[str, Any]:
        """The window as ``PUT /api/v1/autoscaler/windows`` takes it, without the fields at defaults."""
        out: dict[str, Any] = {"name": self.name, "cron": self.cron}
        optional = {"duration_s": (self.duration_s, 0.0), "end_cron": (self.end_cron, ""),
                    "timezone": (self.timezone, None), "weekdays": (list(self.weekdays), []),
                    "min_replicas": (self.min_replicas, None), "max_replicas": (self.max_replicas, None)}
        out.update({k: v for k, (v, unset) in optional.items() if v != unset})
        return out


@dataclass(slots=True, frozen=True)
class Windows:
    now: float
    source: str  # config, or api once set through the API
    active: str | None  # the active window's name
    windows: tuple[ScheduleWindow, ...]
