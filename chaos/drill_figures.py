"""The figures of one RTO/RPO drill, derived from the load client's timeline alone; the prediction made
before the fault and the verdict against the scenario's targets. Pure: no I/O, no clock.

Where it sits: :mod:`chaos.drills` runs a drill (steady state, load, fault at t0, observe, revert) and
hands this module the load client's per-request JSONL records (:func:`client_timeline` puts them on the
wall clock), the fleet samples it polled (:class:`FleetSample`) and t0, the moment its fault took effect;
:func:`derive_figures` returns the :class:`Figures`, :func:`verdict` checks them against the scenario's
targets, :func:`predict` gives the RTO expected from the control plane's :class:`Timings`, and
:func:`timeline_series` the per-bin series a report plots. All times are wall-clock POSIX seconds on the
drill's host; :meth:`Figures.relative` gives them relative to t0.

Definitions (``derive_figures``; ``Thresholds`` are computed from the pre-fault part of the same run):

- *stream points* of a request: its send time, the arrival time of each token chunk, and, when it failed,
  the time the failure reached the client. A *gap* is the time between two consecutive points.
- *thresholds*: ``detect_gap_s = max(0.05, 1.5 * p99 baseline inter-token gap)``;
  ``disrupt_gap_s = max(0.25, 3 * p99 baseline inter-token gap)`` for gaps after the first token and
  ``max(0.25, 3 * p99 baseline TTFT)`` for the first token. Baseline: requests that ended before t0.
- *affected request*: a request that failed at or after t0, or one served by a replica the fault hit (by
  the ``x-replica-id`` the client got) that was in flight at t0, or sent after t0 (and before the fleet's
  capacity was back, ``t_capacity``) and had a gap longer than its disrupt threshold, or one the gateway
  sent to a replica the fault hit and moved elsewhere before
  its first token (the ``x-gateway-tried`` header the client got: the client saw only a late first token).
  Its *disruption* is that failure or gap (for a request in flight on a target at t0: its longest gap
  ending at or after t0; for a moved request: send to first token); it *recovered* at the gap's end when
  that end is a token.
  Requests on the survivors that merely slow down under the extra load are not affected: that is
  degradation, and ``t_slo`` measures it.
- ``t_detect``: the earliest moment after t0 at which a client could tell: an affected request had waited
  ``detect_gap_s`` without a token (gap start + ``detect_gap_s``, not before t0), or got an error.
  None when no affected request waited that long (the fault was invisible to the client).
- ``t_switch``: the first token of a request sent at or after ``t_detect`` (t0 when None) and served by a
  replica the fault did not hit: new traffic flows to the survivors.
- ``t_first_ok``: the first token an affected request received after its disruption.
- ``t_service``: the last such token (every affected stream flows again); ``RTO_service = t_service - t0``
  (0 when nothing was affected and tokens flowed after t0; None, *not measured*, when no affected stream
  flowed again or no token came after t0: a verdict fails an unmeasured figure, never reads it as 0).
  ``outages_s`` lists each recovered request's own outage, ``resume token - max(t0, gap start)``;
  ``rto_service_p99_s`` is its 99th percentile.
- ``t_slo``: windows of ``slo.window_s`` from t0; a window's samples are each request's TTFT (at its first
  token), each affected request's disruption length (at its recovery) and each failure (at its error).
  A window is met when it has samples, their P99 is at most ``slo.ttft_p99_s`` and their error share at
  most ``slo.error_rate``; empty windows neither count nor break a run. ``t_slo`` is the start of the
  first of ``slo.windows`` consecutive met windows; ``RTO_slo = t_slo - t0``.
- ``t_capacity``: from the fleet samples polled during the drill: the first sample at or after t0 from
  which every later sample has ready >= desired and no rollout in progress. ``RTO_capacity =
  t_capacity - t0``; None when the last sample still lacked capacity (the deadline passed).
- RPO: ``requests_failed`` (every request of the run that did not end with ``data: [DONE]`` and status
  200, including those cancelled at the load's hard stop); ``requests_resumed`` (the gateway's
  ``gateway.resumed`` events during the load: streams continued on another replica); ``tokens_lost`` and
  ``tokens_duplicated`` (successful streams only: the usage ``completion_tokens`` the client received
  against the ``max_tokens`` it was owed, since with ``ignore_eos`` an undisturbed greedy stream has exactly
  that many; below is lost, above is duplicated); ``writes_lost`` (marker records written to the store and
  acknowledged before t0 that are missing afterwards). ``requests_resumed`` and ``writes_lost`` need the
  gateway and the store: :func:`derive_figures` leaves them None and the drill runner fills them in.

Limit, said plainly: the load client's JSONL records token arrival times and counts, not token text, so
the token check is by count; the gateway's own regenerated-prefix check guards content on resume.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chaos.scenarios import TARGET_FIGURES, Scenario, SloTarget, Targets
from inference.bench.report import RequestRecord

MIN_DETECT_GAP_S = 0.05
MIN_DISRUPT_GAP_S = 0.25
TIMELINE_BIN_S = 0.5


# ---- the client timeline ------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class ClientRequest:
    """One request as the client saw it, on the wall clock."""

    index: int
    send: float
    first_token: float | None
    token_times: tuple[float, ...]
    end: float | None
    ok: bool
    replica_id: str | None
    output_len: int
    completion_tokens: int | None
    error_kind: str | None = None
    tried: tuple[str, ...] = ()  # replicas the gateway tried first (failed before the first byte)

    @property
    def points(self) -> list[float]:
        pts = [self.send, *self.token_times]
        if not self.ok and self.end is not None:
            pts.append(max(self.end, pts[-1]))
        return pts


def client_timeline(records: Iterable[RequestRecord]) -> list[ClientRequest]:
    """The load client's records on the wall clock (its times are offsets on the run's monotonic clock)."""
    out = []
    for r in records:
        def wall(t: float | None, r: RequestRecord = r) -> float | None:
            return None if t is None else r.send_wall + (t - r.send_time)

        out.append(ClientRequest(
            index=r.index, send=r.send_wall, first_token=wall(r.first_token_time),
            token_times=tuple(r.send_wall + (t - r.send_time) for t in r.token_times), end=wall(r.end_time),
            ok=r.is_success, replica_id=r.replica, output_len=r.output_len,
            completion_tokens=r.completion_tokens, error_kind=r.error_kind, tried=tuple(r.tried)))
    return sorted(out, key=lambda c: c.send)


@dataclass(slots=True, frozen=True)
class FleetSample:
    t: float  # wall clock
    ready: int
    desired: int
    changing: bool = False  # a rollout is in progress

    @property
    def has_capacity(self) -> bool:
        return self.ready >= self.desired and not self.changing


# ---- figures (pure) -------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Thresholds:
    detect_gap_s: float
    disrupt_gap_s: float
    disrupt_ttft_s: float

    @classmethod
    def from_baseline(cls, requests: Sequence[ClientRequest], t0: float) -> Thresholds:
        done = [r for r in requests if r.ok and r.end is not None and r.end < t0]
        itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
        ttft = [r.first_token - r.send for r in done if r.first_token is not None]
        p99_itl, p99_ttft = percentile(itl, 99) or 0.0, percentile(ttft, 99) or 0.0
        return cls(max(MIN_DETECT_GAP_S, 1.5 * p99_itl), max(MIN_DISRUPT_GAP_S, 3 * p99_itl),
                   max(MIN_DISRUPT_GAP_S, 3 * p99_ttft))


@dataclass(slots=True, frozen=True)
class Disruption:
    index: int
    start: float
    end: float
    recovered: bool  # the gap ended with a token (else with the request's failure)


@dataclass(slots=True)
class Figures:
    t0: float
    thresholds: Thresholds
    t_detect: float | None = None
    t_switch: float | None = None
    t_first_ok: float | None = None
    t_service: float | None = None
    t_slo: float | None = None
    t_capacity: float | None = None
    rto_service_s: float | None = None
    rto_service_p99_s: float | None = None
    rto_slo_s: float | None = None
    rto_capacity_s: float | None = None
    outages_s: list[float] = field(default_factory=list)
    requests_total: int = 0
    requests_affected: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    requests_resumed: int | None = None
    tokens_lost: int = 0
    tokens_duplicated: int = 0
    writes_lost: int | None = None
    baseline_slo_met: bool | None = None
    rto_api_s: float | None = None  # control-plane-crash: its restart to the API's first answer
    faults_past_expiry: int | None = None  # faults still in effect after their expiry
    orphans: int | None = None  # processes of the state folder that no control plane owns
    # slice-experiment, from its report: the uncoloured requests' failures, seconds from its start to its
    # stop on the deviation (None: it stopped otherwise), the sides its report leaves without a request
    uncoloured_failed: int | None = None
    slice_stop_s: float | None = None
    slice_sides_missing: int | None = None

    def relative(self) -> dict[str, Any]:
        """The figures with every ``t_*`` given as seconds after t0 (what a report shows)."""
        body = dataclasses.asdict(self)
        for name in ("t_detect", "t_switch", "t_first_ok", "t_service", "t_slo", "t_capacity"):
            value = getattr(self, name)
            body[name] = None if value is None else round(value - self.t0, 4)
        return body


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def disruption_of(request: ClientRequest, t0: float, th: Thresholds, *, on_target: bool,
                  moved: bool = False) -> Disruption | None:
    """The request's disruption after t0 (see the module docstring), or None when it had none;
    ``moved``: the gateway moved it off a replica the fault hit before its first token."""
    points = request.points
    gaps = [(a, b, i == 0) for i, (a, b) in enumerate(itertools.pairwise(points)) if b >= t0]
    failed_end = not request.ok and request.end is not None and request.end >= t0
    if failed_end:
        start = points[-2] if len(points) >= 2 else request.send
        return Disruption(request.index, start, points[-1], recovered=False)
    if moved and request.first_token is not None and request.first_token >= t0:
        return Disruption(request.index, request.send, request.first_token, recovered=True)
    if not on_target:
        return None
    long = [(a, b) for a, b, first in gaps if b - a > (th.disrupt_ttft_s if first else th.disrupt_gap_s)]
    if long:
        a, b = long[0]
        return Disruption(request.index, a, b, recovered=True)
    in_flight = request.send <= t0 and (request.end is None or request.end >= t0)
    if in_flight and gaps:
        a, b, _ = max(gaps, key=lambda g: g[1] - g[0])
        return Disruption(request.index, a, b, recovered=True)
    return None


def derive_figures(requests: Sequence[ClientRequest], samples: Sequence[FleetSample], *, t0: float,
                   slo: SloTarget, fault_targets: Iterable[str] = (),
                   thresholds: Thresholds | None = None) -> Figures:
    """Every client-side figure of one drill (see the module docstring for the definitions)."""
    th = thresholds or Thresholds.from_baseline(requests, t0)
    hit = set(fault_targets)
    fig = Figures(t0=t0, thresholds=th, requests_total=len(requests))
    fig.t_capacity = capacity_restored_at(samples, t0)
    fig.rto_capacity_s = None if fig.t_capacity is None else fig.t_capacity - t0
    # A request sent to a target once the fleet's capacity was back (a killed replica restarted and ready)
    # met the replica after the fault: a slow gap of its own is not the fault's (a clean-clone run counted
    # one such 0.27 s gap on a restarted replica as a 6.8 s RTO).
    back = math.inf if fig.t_capacity is None else fig.t_capacity
    disruptions = [d for r in requests
                   if (d := disruption_of(r, t0, th, on_target=r.replica_id in hit and r.send < back,
                                          moved=not hit.isdisjoint(r.tried))) is not None]
    fig.requests_affected = len(disruptions)
    _service_times(fig, requests, disruptions, hit, th)
    fig.t_slo = slo_recovered_at(requests, disruptions, t0=t0, slo=slo)
    fig.rto_slo_s = None if fig.t_slo is None else fig.t_slo - t0
    fig.baseline_slo_met = baseline_slo_met(requests, t0=t0, slo=slo)
    _rpo(fig, requests)
    return fig


def _service_times(fig: Figures, requests: Sequence[ClientRequest], disruptions: Sequence[Disruption],
                   hit: set[str], th: Thresholds) -> None:
    t0 = fig.t0
    seen = [max(t0, d.start + th.detect_gap_s) for d in disruptions
            if d.recovered and d.end - d.start > th.detect_gap_s]
    seen += [max(t0, min(d.end, d.start + th.detect_gap_s)) for d in disruptions if not d.recovered]
    fig.t_detect = min(seen, default=None)
    since = t0 if fig.t_detect is None else fig.t_detect
    fig.t_switch = min((r.first_token for r in requests if r.send >= since and r.first_token is not None
                        and r.replica_id not in hit), default=None)
    recovered = [d for d in disruptions if d.recovered]
    fig.t_first_ok = min((d.end for d in recovered), default=None)
    fig.t_service = max((d.end for d in recovered), default=None)
    fig.outages_s = sorted(round(d.end - max(t0, d.start), 4) for d in recovered)
    if fig.t_service is not None:
        fig.rto_service_s = max(fig.t_service - t0, 0.0)
        fig.rto_service_p99_s = percentile(fig.outages_s, 99)
    elif not disruptions and any(t >= t0 for r in requests for t in r.token_times):
        fig.rto_service_s = fig.rto_service_p99_s = 0.0  # service seen after t0, and nothing interrupted
    # else None: no affected stream flowed again, or no token came after t0 at all (not measured)


def _samples(requests: Sequence[ClientRequest],
             disruptions: Sequence[Disruption]) -> list[tuple[float, float | None]]:
    """(time, latency) per client observation; latency None marks a failure."""
    out: list[tuple[float, float | None]] = []
    for r in requests:
        if r.first_token is not None:
            out.append((r.first_token, r.first_token - r.send))
        if not r.ok and r.end is not None:
            out.append((r.end, None))
    out += [(d.end, d.end - d.start) for d in disruptions if d.recovered]
    return out


def _window_met(samples: Sequence[float | None], slo: SloTarget) -> bool:
    latencies = [s for s in samples if s is not None]
    errors = len(samples) - len(latencies)
    p99 = percentile(latencies, 99)
    return errors / len(samples) <= slo.error_rate and (p99 is None or p99 <= slo.ttft_p99_s)


def slo_recovered_at(requests: Sequence[ClientRequest], disruptions: Sequence[Disruption], *, t0: float,
                     slo: SloTarget) -> float | None:
    samples = [(t, v) for t, v in _samples(requests, disruptions) if t >= t0]
    if not samples:
        return None
    last = max(t for t, _ in samples)
    windows: dict[int, list[float | None]] = {}
    for t, v in samples:
        windows.setdefault(int((t - t0) // slo.window_s), []).append(v)
    run_start: int | None = None
    run = 0
    for i in range(int((last - t0) // slo.window_s) + 1):
        if i not in windows:
            continue
        if _window_met(windows[i], slo):
            run_start = i if run == 0 else run_start
            run += 1
            if run >= slo.windows:
                assert run_start is not None
                return t0 + run_start * slo.window_s
        else:
            run, run_start = 0, None
    return None


def baseline_slo_met(requests: Sequence[ClientRequest], *, t0: float, slo: SloTarget) -> bool | None:
    """Whether the pre-fault part of the run met the SLO as a whole (None: no samples before t0)."""
    before = [v for t, v in _samples(requests, ()) if t < t0]
    return _window_met(before, slo) if before else None


def capacity_restored_at(samples: Sequence[FleetSample], t0: float) -> float | None:
    after = [s for s in samples if s.t >= t0]
    if not after or not after[-1].has_capacity:
        return None
    restored = after[-1].t
    for s in reversed(after):
        if not s.has_capacity:
            break
        restored = s.t
    return restored


def _rpo(fig: Figures, requests: Sequence[ClientRequest]) -> None:
    fig.requests_failed = sum(1 for r in requests if not r.ok)
    fig.requests_cancelled = sum(1 for r in requests if r.error_kind == "cancelled")
    for r in requests:
        if r.ok and r.completion_tokens is not None:
            fig.tokens_lost += max(r.output_len - r.completion_tokens, 0)
            fig.tokens_duplicated += max(r.completion_tokens - r.output_len, 0)


# ---- prediction and verdict -----------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Timings:
    """What the control plane measured or is configured with, for the prediction."""

    replica_start_s: float | None  # median seconds from spawn to ready (fleet events); None: never seen
    health_interval_s: float
    reconcile_interval_s: float
    stall_timeout_s: float
    first_byte_timeout_s: float
    restart_backoff_s: float
    rollout_observe_s: float
    replicas: int


@dataclass(slots=True, frozen=True)
class Prediction:
    rto_service_s: float
    rto_capacity_s: float | None
    parts: Mapping[str, float]


def predict(sc: Scenario, timings: Timings, *, num_hit: int, ttft_s: float, e2e_s: float) -> Prediction:
    """RTO predicted before the fault from detection intervals, the measured replica start time and the
    backlog the survivors must absorb (Little's law: rate x e2e x share hit, re-prefilled on survivors).

    A replica that stops answering is noticed by its open streams after the stall timeout; at that moment
    the gateway also moves the requests still waiting there for a first token and routes new ones around
    it, so the stall timeout bounds detection. (A replica with nothing under way when it stops is found by
    the gateway's active check within ``probe_interval_s`` more; the drills aim at the busiest replica.)
    """
    stall = timings.stall_timeout_s
    detect = {"reset": 0.0, "stall": stall, "degraded": 0.0, "none": 0.0}[sc.detection]
    survivors = max(timings.replicas - num_hit, 1)
    share = num_hit / max(timings.replicas, 1)
    displaced = sc.rate * e2e_s * share
    backlog = displaced * ttft_s / survivors
    service = detect + ttft_s + backlog if sc.detection != "none" else 0.0
    start = timings.replica_start_s
    parts = {"detect_s": detect, "reprefill_s": ttft_s, "backlog_s": backlog, "displaced": displaced}
    capacity: float | None
    if sc.action == "rollout":
        capacity = None if start is None else timings.replicas * (start + timings.rollout_observe_s)
    elif sc.detection == "degraded":
        capacity = 0.0
    elif sc.fleet_repairs:
        fleet_detect = timings.reconcile_interval_s
        capacity = None if start is None else fleet_detect + timings.restart_backoff_s + start
        parts["fleet_detect_s"] = fleet_detect
    else:  # capacity comes back when the fault is reverted and the next readiness probe passes
        capacity = sc.fault_duration_s + timings.health_interval_s
    if start is not None:
        parts["replica_start_s"] = start
    return Prediction(round(service, 4), None if capacity is None else round(capacity, 4), parts)


@dataclass(slots=True, frozen=True)
class ClientLoss:
    """What clients lost when their entry point died (a gateway process killed), and what a client-side
    retry policy would have recovered: a request that failed before its first token is safe to send again
    (nothing was delivered), one cut mid-stream needs a resume from the tokens it already has (a plain
    retry would repeat them)."""

    rto_service_s: float  # t0 to the first request sent after the last failure that then succeeded
    failed: int
    failed_before_first_token: int  # a retry after the restart recovers these
    failed_mid_stream: int  # a retry repeats their delivered tokens; a resume recovers them
    tokens_delivered_to_failed: int


def client_loss(requests: Sequence[ClientRequest], t0: float) -> ClientLoss:
    failed = [r for r in requests if not r.ok and (r.end or r.send) >= t0]
    before = [r for r in failed if r.first_token is None]
    last_failure = max((r.send for r in failed), default=t0)
    back = min((r.send for r in requests if r.ok and r.send >= last_failure), default=None)
    rto = 0.0 if not failed else (back - t0 if back is not None else math.inf)
    return ClientLoss(round(max(rto, 0.0), 4), len(failed), len(before), len(failed) - len(before),
                      sum(len(r.token_times) for r in failed))


NOT_MEASURED = "not measured"


@dataclass(slots=True, frozen=True)
class Check:
    """One target against its figure: ``outcome`` is "pass", "fail" or "not measured" (which fails too:
    ``ok`` is True only for a pass)."""

    name: str
    target: float
    measured: float | None
    ok: bool
    outcome: str = ""

    def __post_init__(self) -> None:
        if not self.outcome:
            object.__setattr__(self, "outcome", check_outcome(self.measured, self.target))


def check_outcome(measured: float | None, target: float) -> str:
    """"pass" (at most the target), "fail", or "not measured" (None: never counted as 0)."""
    if measured is None:
        return NOT_MEASURED
    return "pass" if measured <= target else "fail"


def verdict(fig: Figures, targets: Targets) -> list[Check]:
    """One check per target that is set; a figure that could not be measured fails its check (its outcome
    says "not measured")."""
    checks = []
    for target_name, figure in TARGET_FIGURES.items():
        target = getattr(targets, target_name)
        if target is not None:
            measured = getattr(fig, figure)
            checks.append(Check(figure, target, measured, check_outcome(measured, target) == "pass"))
    return checks


def timeline_series(requests: Sequence[ClientRequest], samples: Sequence[FleetSample],
                    t0: float) -> dict[str, Any]:
    """Per-bin client series relative to t0 (sent per second, errors, P99 TTFT) and the ready replicas."""
    if not requests:
        return {"t": [], "sent_rps": [], "errors": [], "ttft_p99_s": [], "ready": []}
    start = min(r.send for r in requests)
    end = max(max(r.points) for r in requests)
    num = int((end - start) // TIMELINE_BIN_S) + 1
    sent = [0] * num
    errors = [0] * num
    ttfts: list[list[float]] = [[] for _ in range(num)]
    for r in requests:
        sent[int((r.send - start) // TIMELINE_BIN_S)] += 1
        if not r.ok and r.end is not None:
            errors[min(int((r.end - start) // TIMELINE_BIN_S), num - 1)] += 1
        if r.first_token is not None:
            ttfts[int((r.first_token - start) // TIMELINE_BIN_S)].append(r.first_token - r.send)
    return {
        "t": [round(start + i * TIMELINE_BIN_S - t0, 3) for i in range(num)],
        "sent_rps": [n / TIMELINE_BIN_S for n in sent],
        "errors": errors,
        "ttft_p99_s": [None if not v else round(percentile(v, 99) or 0.0, 4) for v in ttfts],
        "ready": [[round(s.t - t0, 3), s.ready, s.desired] for s in samples],
    }
