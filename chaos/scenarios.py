"""The shipped drill scenarios, by id: what each one breaks, under what load, and what it must meet.

A :class:`Scenario` is a frozen value: the fault steps (or the rolling update) to start at t0, the load to
run around them (:class:`LoadProfile`: Poisson at a rate, or a window of an Azure LLM trace replayed), the
replicas or zone the caller aimed it at, the SLO that says when service is back, and the targets the verdict
is judged against. :func:`scenario` looks one up by id and :meth:`Scenario.with_overrides` returns a copy with
the caller's load, aim and target overrides checked (a ValueError names the field). ``chaos.drills`` runs
them and checks the aim against the fleet.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from chaos.drill_trace import resolve_trace, trace_offsets
from inference.bench.datasets import AZURE_TRACE as AZURE_TRACE  # re-exported to the control plane
from inference.bench.datasets import AZURE_TRACE_ENV as AZURE_TRACE_ENV

# What happens at t0: faults through the fault manager, a rolling update, the kill of one gateway process,
# ``kill -9`` of the control plane itself (run from outside it, restarted after ``outage_s``), or a slice
# experiment (a coloured fault on a share of the load, against a control slice; ``SliceStep``).
Action = Literal["fault", "rollout", "gateway-crash", "control-plane-crash", "slice-experiment"]
LoadKind = Literal["rate", "trace"]
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
    rto_api_s: float | None = None  # control-plane-crash: its restart to the API's first answer
    max_faults_past_expiry: int | None = None  # faults still in effect after their expiry
    max_orphans: int | None = None  # processes of this state folder that no control plane owns
    # slice-experiment: failures of the requests in neither colour (the fault must not reach them), the
    # seconds from its start to its stop on the deviation (not measured when it stopped otherwise), and
    # the sides (experiment, control) its report leaves without a request
    max_uncoloured_failed: int | None = None
    max_slice_stop_s: float | None = None
    max_slice_sides_missing: int | None = None


# Each target bounds one figure of the report (``chaos.drill_figures.Figures``): target name -> figure name.
TARGET_FIGURES: dict[str, str] = {
    "rto_service_s": "rto_service_s", "rto_slo_s": "rto_slo_s", "rto_capacity_s": "rto_capacity_s",
    "max_failed_requests": "requests_failed", "max_tokens_lost": "tokens_lost",
    "max_tokens_duplicated": "tokens_duplicated", "max_writes_lost": "writes_lost", "rto_api_s": "rto_api_s",
    "max_faults_past_expiry": "faults_past_expiry", "max_orphans": "orphans",
    "max_uncoloured_failed": "uncoloured_failed", "max_slice_stop_s": "slice_stop_s",
    "max_slice_sides_missing": "slice_sides_missing",
}


@dataclass(slots=True, frozen=True)
class FaultStep:
    """One fault injected at t0. ``zone="first"`` aims at every replica of the first zone that has one."""

    kind: str
    selector: str = "COUNT(1)"
    params: Mapping[str, float | int | str | bool] = field(default_factory=dict)
    duration_s: float = 5.0
    zone: str | None = None
    allow_all: bool = False

    @property
    def is_single(self) -> bool:
        """Aimed at one replica: ``COUNT(1)`` with no zone."""
        return self.selector.replace(" ", "").upper() == "COUNT(1)" and not self.zone


@dataclass(slots=True, frozen=True)
class SliceStep:
    """A slice experiment started at t0 (``controlplane.rollouts.experiment``): ``fault`` with ``params`` on
    the requests of a ``share`` colour, against a control colour of the same share, stopping itself when the
    experiment side deviates beyond the bounds (or after ``duration_s``)."""

    share: float = 0.1
    fault: str = "error_rate"
    params: Mapping[str, float | int | str | bool] = field(default_factory=lambda: {"probability": 1.0})
    duration_s: float = 14.0  # ends inside the load (from t0), so the drill reads its whole record
    check_interval_s: float = 0.5
    bounds: Mapping[str, float] = field(default_factory=lambda: {"max_error_increase": 0.05,
                                                                 "min_samples": 8})

    def spec(self) -> dict[str, Any]:
        """As the control plane's slice experiments take it."""
        return {"share": self.share, "fault": self.fault, "params": dict(self.params),
                "duration_s": self.duration_s, "check_interval_s": self.check_interval_s,
                "bounds": dict(self.bounds)}


# "azure" as a trace (AZURE_TRACE, AZURE_TRACE_ENV from inference.bench.datasets): the file named by
# $CONTROLPLANE_AZURE_TRACE, else the Azure LLM conversation trace that ships with the load client.
# Trace prompts are capped here: the Azure conversation trace asks for up to 14k context tokens, more than the
# default model's 2048 positions, and long prefills on a busy CPU would measure prefill, not a failover.
TRACE_MAX_INPUT_LEN = 512
# Three replicas starting at once on a busy 2-core machine take up to about two minutes to be ready.
STEADY_STATE_TIMEOUT_S = 180.0


@dataclass(slots=True, frozen=True)
class LoadProfile:
    """How the load client sends requests: ``rate`` (Poisson arrivals at the scenario's ``rate``) or
    ``trace`` (the window ``[trace_start_s, trace_start_s + duration_s * compress)`` of an Azure LLM trace
    replayed ``compress`` times faster, token counts times ``token_scale``, prompts capped at
    ``max_input_len`` and outputs at the scenario's ``max_tokens``). Either way the load lasts the
    scenario's ``duration_s``. ``trace`` is what was asked ("azure" or a path), ``path`` the file read and
    ``requests`` the number of trace requests in the window."""

    kind: LoadKind = "rate"
    trace: str | None = None
    path: str | None = None
    compress: float = 1.0
    token_scale: float = 1.0
    trace_start_s: float = 0.0
    max_input_len: int = TRACE_MAX_INPUT_LEN
    requests: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("rate", "trace"):
            raise ValueError(f"load.kind: must be 'rate' or 'trace', got {self.kind!r}")
        _positive(**{"load.compress": self.compress, "load.token_scale": self.token_scale})
        if self.trace_start_s < 0:
            raise ValueError(f"load.trace_start_s: must be >= 0, got {self.trace_start_s!r}")
        if self.max_input_len < 1:
            raise ValueError(f"load.max_input_len: must be >= 1, got {self.max_input_len!r}")
        if self.kind == "trace" and not self.path:
            raise ValueError("load.trace: a trace load needs a trace file ('azure' or a path)")

    @property
    def is_trace(self) -> bool:
        return self.kind == "trace"


@dataclass(slots=True, frozen=True)
class Scenario:
    id: str
    title: str
    description: str
    detection: Detection
    faults: tuple[FaultStep, ...] = ()
    action: Action = "fault"
    rate: float = 4.0  # requests per second (Poisson); a trace load: the window's mean, for the prediction
    duration_s: float = 14.0  # load duration
    fault_at_s: float = 4.0  # t0, seconds into the load
    max_tokens: int = 24
    input_len: int = 32
    capacity_deadline_s: float = 90.0  # observation ends at t0 + this at the latest
    outage_s: float = 10.0  # control-plane-crash: how long the control plane stays down
    # A fleet still starting (right after ``controlplane up``) or a gateway not yet routing is waited for,
    # up to this long, before the drill gives up with the reasons it waited on.
    steady_state_timeout_s: float = STEADY_STATE_TIMEOUT_S
    slo: SloTarget = field(default_factory=SloTarget)
    targets: Targets = field(default_factory=Targets)
    fleet_repairs: bool = True  # the fleet restarts what the fault took (else capacity returns at revert)
    load: LoadProfile = field(default_factory=LoadProfile)
    # Aim (empty: the default): the replica a single-replica fault hits, or the zone whose busiest replica
    # it hits; the zone a zone fault takes. Checked against the fleet by ``chaos.drills`` at the start.
    replicas: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()
    slice_step: SliceStep | None = None  # slice-experiment: what it runs at t0

    def __post_init__(self) -> None:
        _positive(rate=self.rate, duration_s=self.duration_s, capacity_deadline_s=self.capacity_deadline_s,
                  outage_s=self.outage_s, steady_state_timeout_s=self.steady_state_timeout_s)
        if not 0 < self.fault_at_s < self.duration_s:
            raise ValueError(f"fault_at_s: must be inside the load (0, {self.duration_s:g}), "
                             f"got {self.fault_at_s!r}")
        if self.max_tokens < 1 or self.input_len < 1:
            raise ValueError("max_tokens and input_len: must be >= 1")
        if self.action == "fault" and not self.faults:
            raise ValueError(f"{self.id}: a fault scenario needs at least one fault step")
        if (self.action == "slice-experiment") != (self.slice_step is not None):
            raise ValueError(f"{self.id}: a slice-experiment scenario, and only one, takes a slice step")
        self._check_aim()

    @property
    def takes_zone(self) -> bool:
        """A zone fault (every replica of one zone)."""
        return any(f.zone for f in self.faults)

    @property
    def takes_replica(self) -> bool:
        """A single-replica fault (``COUNT(1)``, no zone)."""
        return any(f.is_single for f in self.faults)

    def _check_aim(self) -> None:
        field_given = "replicas" if self.replicas else "zones"
        if (self.replicas or self.zones) and not (self.takes_zone or self.takes_replica):
            raise ValueError(f"{field_given}: {self.id} takes no target (it acts on the whole fleet)")
        if self.takes_zone:
            if self.replicas:
                raise ValueError(f"replicas: {self.id} takes one zone (zones), not replicas")
            if len(self.zones) > 1:
                raise ValueError(f"zones: {self.id} takes one zone, got {len(self.zones)}")
        if self.takes_replica:
            if len(self.replicas) > 1:
                raise ValueError(f"replicas: {self.id} takes one replica, got {len(self.replicas)}")
            if len(self.zones) > 1:
                raise ValueError(f"zones: {self.id} takes one zone (its busiest replica is hit), "
                                 f"got {len(self.zones)}")

    @property
    def fault_duration_s(self) -> float:
        return max((f.duration_s for f in self.faults), default=0.0)

    def with_overrides(self, overrides: Mapping[str, Any]) -> Scenario:
        """A copy with load fields (rate, duration_s, fault_at_s, max_tokens, input_len,
        capacity_deadline_s, outage_s, steady_state_timeout_s), the load profile (``load``: ``{"kind":
        "rate", "rate": R}`` or ``{"kind": "trace", "trace": "azure" | PATH, "compress": X, "token_scale":
        Y, "trace_start_s": S, "max_input_len": N}``), the aim (``replicas``, ``zones``: lists of names)
        and target fields (``targets.<name>`` or the bare name) replaced. A trace is read here: a missing
        or malformed file is a ValueError naming ``load.trace``."""
        load: dict[str, Any] = {}
        targets: dict[str, Any] = {}
        profile: Mapping[str, Any] | None = None
        target_names = {f.name for f in dataclasses.fields(Targets)}
        for name, value in overrides.items():
            if value is None:
                continue
            bare = name.removeprefix("targets.")
            if name in _LOAD_FIELDS:
                load[name] = _number(name, value)
            elif name == "load":
                if not isinstance(value, Mapping):
                    raise ValueError(f"load: expected an object with a kind, got {value!r}")
                profile = value
            elif name in ("replicas", "zones"):
                load[name] = _names(name, value)
            elif bare in target_names:
                targets[bare] = _number(name, value)
            else:
                allowed = ", ".join(sorted(_LOAD_FIELDS | _AIM_FIELDS | target_names))
                raise ValueError(f"{name}: unknown override (allowed: {allowed})")
        for name in ("max_tokens", "input_len"):
            if name in load:
                load[name] = int(load[name])
        if profile is not None:
            load.update(_load_profile(profile, rate=load.get("rate")))
        if targets:
            load["targets"] = dataclasses.replace(self.targets, **targets)
        changed = dataclasses.replace(self, **load)
        return changed._with_trace_window() if changed.load.is_trace else changed

    def _with_trace_window(self) -> Scenario:
        """The trace window's request count and mean rate (requests per second of load) filled in."""
        profile = self.load
        assert profile.path is not None  # LoadProfile requires it for a trace
        start = profile.trace_start_s
        end = start + self.duration_s * profile.compress
        try:
            count = sum(1 for t in trace_offsets(Path(profile.path)) if start <= t < end)
        except (OSError, ValueError, csv.Error) as exc:
            raise ValueError(f"load.trace: {exc}") from exc
        if count == 0:
            raise ValueError(f"load.trace_start_s: {profile.path} has no request in the window "
                             f"[{start:g}, {end:g}) s of the trace")
        return dataclasses.replace(self, rate=round(count / self.duration_s, 4),
                                   load=dataclasses.replace(profile, requests=count))

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_LOAD_FIELDS = frozenset({"rate", "duration_s", "fault_at_s", "max_tokens", "input_len",
                          "capacity_deadline_s", "outage_s", "steady_state_timeout_s"})
_AIM_FIELDS = frozenset({"load", "replicas", "zones"})
_RATE_KEYS = frozenset({"kind", "rate"})
_TRACE_KEYS = frozenset({"kind", "trace", "compress", "token_scale", "trace_start_s", "max_input_len"})


def _load_profile(spec: Mapping[str, Any], *, rate: float | None) -> dict[str, Any]:
    """The scenario fields a ``load`` override sets: ``load`` and, for a rate load, ``rate``."""
    kind = spec.get("kind")
    if kind not in ("rate", "trace"):
        raise ValueError(f"load.kind: must be 'rate' or 'trace', got {kind!r}")
    allowed = _RATE_KEYS if kind == "rate" else _TRACE_KEYS
    for key in spec:
        if key not in allowed:
            raise ValueError(f"load.{key}: unknown for a {kind} load (allowed: {', '.join(sorted(allowed))})")
    if kind == "rate":
        out: dict[str, Any] = {"load": LoadProfile()}
        if spec.get("rate") is not None:
            given = _number("load.rate", spec["rate"])
            if rate is not None and rate != given:
                raise ValueError(f"rate: {rate:g} disagrees with load.rate {given:g}; give one")
            _positive(**{"load.rate": given})
            out["rate"] = given
        return out
    if rate is not None:
        raise ValueError("rate: a trace load takes its arrivals from the trace; leave rate out")
    name = spec.get("trace")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"load.trace: give {AZURE_TRACE!r} or the path of an Azure LLM trace CSV, "
                         f"got {name!r}")
    defaults = LoadProfile()
    number = {key: _number(f"load.{key}", spec.get(key, getattr(defaults, key)))
              for key in ("compress", "token_scale", "trace_start_s", "max_input_len")}
    return {"load": LoadProfile(kind="trace", trace=name.strip(), path=str(resolve_trace(name.strip())),
                                compress=number["compress"], token_scale=number["token_scale"],
                                trace_start_s=number["trace_start_s"],
                                max_input_len=int(number["max_input_len"]))}


def _names(name: str, value: Any) -> tuple[str, ...]:
    """A list of replica ids or zone names, deduplicated in order."""
    if isinstance(value, str) or not isinstance(value, Sequence) or \
            not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{name}: expected a list of names, got {value!r}")
    return tuple(dict.fromkeys(v.strip() for v in value))


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
# A control plane's start after kill -9, to its API's first answer: Python and its imports, the store,
# adopting the fleet, the gateways and the console, Prometheus. About 8 s on a quiet 2-core machine.
_API_RTO_S = 30.0
# The only gateway killed: its restart (0.5 s backoff) and start-up; with several, about 0.
_GATEWAY_RTO_S = 6.0

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
    Scenario("node-loss", "Node loss", "Every cluster node of one zone stops (Ray: its raylet and "
             "everything on it, replicas included): streams resume in the other zones, the fleet re-places "
             "the zone's replicas by its policy (fleet.on_node_loss), and the lab starts the node again "
             "at revert. Needs fleet.backend = \"ray\".", "reset",
             faults=(FaultStep("node-loss", selector="ALL", params={"scope": "zone"}, zone="first",
                               duration_s=8.0),),
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
    Scenario("control-plane-crash", "Control plane crash", "kill -9 of the control plane under load, down "
             "for outage_s, then started again: the data plane serves throughout, the next control plane "
             "adopts it and finds every acknowledged write, and no fault outlives its expiry.", "none",
             action="control-plane-crash", rate=3.0, duration_s=30.0, fault_at_s=6.0, outage_s=10.0,
             capacity_deadline_s=120.0,
             targets=Targets(rto_api_s=_API_RTO_S, max_faults_past_expiry=0, max_orphans=0)),
    Scenario("gateway-crash", "Gateway crash", "kill -9 of one gateway process under load: its streams are "
             "lost to the client, the control plane restarts it; with several gateways the others go on "
             "serving new connections at once.", "reset", action="gateway-crash",
             targets=Targets(rto_service_s=_GATEWAY_RTO_S, max_failed_requests=None, max_tokens_lost=None,
                             max_tokens_duplicated=None)),
    Scenario("slice-error-rate", "Slice experiment: error rate", "Every request of a 10% colour fails "
             "(error_rate, probability 1, on that colour only) while a 10% control colour is measured beside "
             "it: the run stops itself on the deviation, the uncoloured 80% see no failure, and the report "
             "shows both sides with the difference's interval.", "degraded", action="slice-experiment",
             slice_step=SliceStep(), rate=12.0, duration_s=20.0, fault_at_s=3.0, max_tokens=8,
             targets=Targets(max_failed_requests=None, max_uncoloured_failed=0, max_slice_stop_s=20.0,
                             max_slice_sides_missing=0)),
)}


def targets_table() -> str:
    """The shipped scenarios and their targets as a Markdown table: the README quotes it (a test checks
    that it still matches these definitions)."""
    head = ("| scenario | at t0 | load | RTO_service <= | RTO_capacity <= | failed requests <= | tokens lost "
            "/ duplicated <= | acknowledged writes lost <= | other |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for sc in SCENARIOS.values():
        t = sc.targets
        at_t0 = ", ".join(f"`{f.kind}`" + (" (a zone)" if f.zone else "") for f in sc.faults) \
            or f"`{sc.action}`"
        other = [f"{label} <= {_target(getattr(t, name), unit)}" for name, label, unit in _OTHER_TARGETS
                 if getattr(t, name) is not None]
        tokens = "-" if t.max_tokens_lost is None and t.max_tokens_duplicated is None else \
            f"{_target(t.max_tokens_lost)} / {_target(t.max_tokens_duplicated)}"
        lines.append(f"| `{sc.id}` | {at_t0} | {sc.rate:g} req/s x {sc.duration_s:g} s | "
                     f"{_target(t.rto_service_s, 's')} | {_target(t.rto_capacity_s, 's')} | "
                     f"{_target(t.max_failed_requests)} | {tokens} | {_target(t.max_writes_lost)} | "
                     f"{'; '.join(other) or '-'} |")
    return "\n".join(lines)


_OTHER_TARGETS = (("rto_slo_s", "RTO_slo", "s"), ("rto_api_s", "RTO_api", "s"),
                  ("max_faults_past_expiry", "faults past expiry", ""), ("max_orphans", "orphans", ""),
                  ("max_uncoloured_failed", "uncoloured failed", ""),
                  ("max_slice_stop_s", "self-stop on the deviation", "s"),
                  ("max_slice_sides_missing", "sides unreported", ""))


def _target(value: float | None, unit: str = "") -> str:
    """A target as the table shows it (``1 s``); None (not judged) as ``-``."""
    if value is None:
        return "-"
    return f"{value:g} {unit}".strip() if unit else f"{value:g}"


def scenario(scenario_id: str) -> Scenario:
    """The shipped scenario ``scenario_id``; KeyError naming the known ones."""
    try:
        return SCENARIOS[scenario_id]
    except KeyError:
        raise KeyError(f"scenario: unknown {scenario_id!r} (known: {', '.join(SCENARIOS)})") from None
