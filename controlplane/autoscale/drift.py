"""How far the live replicas run from their profile: the engine time they spent against what the profile
predicts for the same steps.

Every count the autoscaler sizes by, and every what-if simulation, prices engine steps with the replica
profile (:mod:`controlplane.autoscale.profile`). A profile measured on another host, or on this host on a
day it ran faster, prices them wrong, and nothing else would say so: the fleet would only look slow.
The replicas export their engine's busy seconds and their steps' work in the profile's own terms (steps,
decoded sequences, prefill tokens, keys the decoded tokens attended to, prefill attention pairs;
:mod:`inference.metrics`). The profile's step time is linear in those terms, so the engine time it
predicts over a window is its coefficients times the terms' rates, exactly, whatever the steps held; the
ratio of the busy time observed to that prediction is the drift: 1.0 on the profile, 1.3 for replicas
running 30% slower than it. Replicas that share a host's cores (more busy replicas than cores) read
slower by the sharing too: the drift is what the profile misses on this host, whatever the cause, and the
per-replica ratios tell one slow replica from a slow host. The replicas also count the CPU seconds their
engine thread ran within its steps (``llmsre_engine_step_cpu_seconds_total``): over the steps' seconds
(busy less turn) that is the share of its step time an engine ran on a core (:attr:`ProfileDrift.on_cpu`),
and the drift times that share is the engine's own cost against the profile
(:attr:`ProfileDrift.cpu_ratio`). Of the rest, the seconds the engine thread waited for a core
(``llmsre_engine_step_runqueue_seconds_total``, its run delay; where the kernel counts it) are the host's
share (other processes or replicas on the same cores: :attr:`ProfileDrift.waiting_core`); the remainder
it slept, on the interpreter lock mostly, which the replica's own HTTP server holds while it streams tokens
and takes in requests (:attr:`ProfileDrift.waiting_lock`). More cores shorten the first, not the second.
One replica alone on an idle 2-core host, serving the Azure trace at 8.7 requests/s (2026-12-07): on a
core 90% of its steps' time, waiting for one 1%, on the lock 9%. The autoscaler puts the drift in every
decision record (with a note when it is beyond :data:`STALE_BEYOND`), the control plane's metrics page and the
console show it, and ``python -m controlplane.bench sim-vs-live`` reports it for the live run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.autoscale.profile import ReplicaProfile
from controlplane.telemetry.base import Telemetry

ENGINE_BUSY = "llmsre_engine_busy_seconds_total"
ENGINE_TURN = "llmsre_engine_turn_seconds_total"  # of the busy seconds, those between two steps
ENGINE_STEP_CPU = "llmsre_engine_step_cpu_seconds_total"  # of the steps' seconds, those on a CPU
ENGINE_STEP_RUNQUEUE = "llmsre_engine_step_runqueue_seconds_total"  # of them, those waiting for a core
STEP_WORK = "llmsre_engine_step_work_total"  # by term, as inference.metrics.STEP_WORK_TERMS names them
# A replica busy less than this share of the window ran too few steps to judge (a few steps' noise, or
# the first step of a shape, would read as drift).
MIN_BUSY_SHARE = 0.05
STALE_BEYOND = 0.25  # a drift further than this from 1.0 says so in the decision record
# A stale drift's note says what the engines waited for when they ran on a core less than this share of their
# steps' time.
STARVED_BELOW = 0.9


def lock_share(on_cpu: float, waiting_core: float) -> float:
    """Of the engines' step time, the share neither on a core nor waiting for one: asleep, on the
    interpreter lock mostly."""
    return max(1.0 - on_cpu - waiting_core, 0.0)


@dataclass(slots=True, frozen=True)
class ProfileDrift:
    """Engine seconds per second observed and predicted by the profile, fleet-wide and per replica."""

    busy_s_per_s: float
    predicted_s_per_s: float
    replicas: Mapping[str, float] = field(default_factory=dict)  # replica -> its own ratio
    # CPU seconds over step seconds of the judged replicas that export both (None: none does)
    on_cpu: float | None = None
    # run-queue seconds over step seconds of those that export these as well (None: none does)
    waiting_core: float | None = None

    @property
    def ratio(self) -> float:
        return self.busy_s_per_s / self.predicted_s_per_s

    @property
    def cpu_ratio(self) -> float | None:
        """The engines' CPU time over the profile's prediction: the drift with waiting for cores taken out."""
        return None if self.on_cpu is None else self.ratio * self.on_cpu

    @property
    def waiting_lock(self) -> float | None:
        """The share of the step time the engines neither ran nor waited for a core: asleep, on the
        interpreter lock mostly (None where the run queue is not counted)."""
        if self.on_cpu is None or self.waiting_core is None:
            return None
        return lock_share(self.on_cpu, self.waiting_core)

    def waits(self) -> str:
        """What the engines' step time was made of, for a note: on a core, and waiting for what."""
        if self.on_cpu is None:
            return ""
        if self.waiting_core is None:
            return (f"the engines ran on a core {self.on_cpu:.0%} of their steps' time and waited for one or "
                    f"for the interpreter lock the rest")
        return (f"the engines ran on a core {self.on_cpu:.0%} of their steps' time, waited for one "
                f"{self.waiting_core:.0%} (other processes or replicas on these cores) and for the "
                f"interpreter lock {self.waiting_lock:.0%} (their own HTTP servers)")

    @property
    def is_stale(self) -> bool:
        return abs(self.ratio - 1.0) > STALE_BEYOND

    def note(self) -> str | None:
        """What the decision record says when the profile is stale; None when it holds."""
        if not self.is_stale:
            return None
        way = "slower" if self.ratio > 1 else "faster"
        waited = ""
        if self.on_cpu is not None and self.on_cpu < STARVED_BELOW:
            waited = f"; {self.waits()}, {self.cpu_ratio:.2f}x the profile on a core"
        return (f"profile drift {self.ratio:.2f}: the replicas ran {way} than their profile "
                f"({self.busy_s_per_s:.3g} engine s/s against {self.predicted_s_per_s:.3g} predicted"
                f"{waited}): a profile from another host or day, or replicas sharing cores; every count "
                f"priced by it is off by as much (`controlplane calibrate` measures this host)")

    def as_dict(self) -> dict[str, Any]:
        out = {"ratio": round(self.ratio, 4), "stale": self.is_stale,
               "busy_s_per_s": round(self.busy_s_per_s, 6),
               "predicted_s_per_s": round(self.predicted_s_per_s, 6),
               "replicas": {r: round(v, 4) for r, v in sorted(self.replicas.items())}}
        if self.on_cpu is not None:
            out["on_cpu"] = round(self.on_cpu, 4)
        if self.waiting_core is not None:
            out["waiting_core"] = round(self.waiting_core, 4)
        return out


def predicted_seconds(profile: ReplicaProfile, work: Mapping[str, float]) -> float:
    """Engine seconds the profile predicts for steps whose summed work per term (the replicas' ``term``
    label) is ``work``."""
    return profile.seconds(steps=work.get("steps", 0.0), num_decode=work.get("decode_sequences", 0.0),
                           num_prefill_tokens=work.get("prefill_tokens", 0.0),
                           context_tokens=work.get("context_tokens", 0.0),
                           prefill_pairs=work.get("prefill_pairs", 0.0))


def drift_from(profile: ReplicaProfile, busy: Mapping[str, float], work: Mapping[str, Mapping[str, float]],
               *, step_cpu: Mapping[str, float] | None = None,
               turn: Mapping[str, float] | None = None,
               runqueue: Mapping[str, float] | None = None) -> ProfileDrift | None:
    """The drift from per-replica busy seconds and work per term (totals over one span, or rates over a
    window: the ratio is the same), and the shares of their steps' seconds on a CPU and waiting for one from
    their step CPU, run-queue and turn seconds where they export them; None when no replica has busy seconds
    and work."""
    ratios: dict[str, float] = {}
    observed = predicted = on_cpu = stepping = queued = queued_stepping = 0.0
    for replica, seconds in busy.items():
        expected = predicted_seconds(profile, work.get(replica, {}))
        if expected <= 0 or seconds <= 0:
            continue
        ratios[replica] = seconds / expected
        observed, predicted = observed + seconds, predicted + expected
        cpu, between = (step_cpu or {}).get(replica), (turn or {}).get(replica, 0.0)
        if cpu is not None and seconds - between > 0:
            on_cpu, stepping = on_cpu + cpu, stepping + seconds - between
            if (waited := (runqueue or {}).get(replica)) is not None:
                queued, queued_stepping = queued + waited, queued_stepping + seconds - between
    if predicted <= 0:
        return None
    return ProfileDrift(observed, predicted, ratios, on_cpu / stepping if stepping > 0 else None,
                        queued / queued_stepping if queued_stepping > 0 else None)


def observe_drift(telemetry: Telemetry, profile: ReplicaProfile, *,
                  window_s: float | None) -> ProfileDrift | None:
    """The drift over the metrics window, of the replicas busy at least :data:`MIN_BUSY_SHARE` of it;
    None when none was (or the replicas export no work counters). Telemetry errors propagate."""
    # One read of every counter, so that busy time, CPU time and work cover the same scrapes: read apart,
    # a scrape between two reads would put one window's CPU seconds over another's busy seconds.
    rates = telemetry.rates((ENGINE_BUSY, ENGINE_STEP_CPU, ENGINE_TURN, ENGINE_STEP_RUNQUEUE, STEP_WORK),
                            window_s=window_s, by=("replica", "term"))
    per_replica = {metric: {group[0]: v for group, v in rates[metric].items()}  # no term label: one each
                   for metric in (ENGINE_BUSY, ENGINE_STEP_CPU, ENGINE_TURN, ENGINE_STEP_RUNQUEUE)}
    busy = {replica: v for replica, v in per_replica[ENGINE_BUSY].items() if v >= MIN_BUSY_SHARE}
    if not busy:
        return None
    work: dict[str, dict[str, float]] = {}
    for (replica, term), value in rates[STEP_WORK].items():
        work.setdefault(replica, {})[term] = value
    return drift_from(profile, busy, work, step_cpu=per_replica[ENGINE_STEP_CPU],
                      turn=per_replica[ENGINE_TURN], runqueue=per_replica[ENGINE_STEP_RUNQUEUE])
