"""What a live run's autoscaler decisions say about how fast its replicas ran against their profile: the
drift over the run, the shares of their step time on a core and waiting for one, and the host's speed
window by window (with the core sharing the simulator models taken out) as a step function the simulator
can replay. Pure: the decision records in, figures out; :mod:`controlplane.bench.sim_vs_live` reads the
records and prints these.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from controlplane.client import Decision


def run_drift(decisions: Sequence[Decision]) -> float | None:
    """The replicas' engine seconds over the profile's prediction across the run: the decisions' windows
    summed (each tick's window weighs as much in both), None when no decision could tell."""
    drifts = [d.inputs.profile_drift for d in decisions if d.inputs.profile_drift]
    busy = sum(float(x["busy_s_per_s"]) for x in drifts)
    predicted = sum(float(x["predicted_s_per_s"]) for x in drifts)
    return busy / predicted if predicted > 0 else None


def run_share(decisions: Sequence[Decision], share: str) -> float | None:
    """A share of the replicas' step time across the run, as the decision records' drift names it
    (``on_cpu``: on a core; ``waiting_core``: waiting for one; :class:`~controlplane.autoscale.drift.
    ProfileDrift`), each decision's weighed by its engine time; None when no decision had it (replicas
    that do not count it)."""
    shares = [(float(x[share]), float(x["busy_s_per_s"])) for d in decisions
              if (x := d.inputs.profile_drift) and x.get(share) is not None]
    weight = sum(w for _, w in shares)
    return sum(v * w for v, w in shares) / weight if weight > 0 else None


def host_speed(decisions: Sequence[Decision], *, window_s: float, cores: int) -> list[tuple[float, float]]:
    """How much slower than the profile the host ran the replicas, window by window, oldest first: each
    decision's drift at its window's middle (POSIX seconds), over the stretch of replicas sharing the
    cores (engine-busy seconds per second over the cores, at least 1), which the simulator applies itself
    (``host_cores``)."""
    speed = []
    for d in sorted(decisions, key=lambda d: d.at):
        drift = d.inputs.profile_drift
        if drift:
            sharing = max(1.0, float(drift["busy_s_per_s"]) / cores)
            speed.append((d.at - window_s / 2, float(drift["ratio"]) / sharing))
    return speed


def speed_at(speed: Sequence[tuple[float, float]], t0: float) -> Callable[[float], float]:
    """``host_speed`` as a step function of seconds since ``t0``: each window's value from its middle
    on, the first one before it."""
    starts = [at - t0 for at, _ in speed]

    def at(now: float) -> float:
        return speed[max(bisect.bisect_right(starts, now) - 1, 0)][1]

    return at
