"""The control plane's state as Prometheus series, read at scrape time: fleet size, the autoscaler's loop
and its last recommendation, drills and faults.

Where it sits: ``GET /metrics/state`` of the REST API (:mod:`controlplane.api.process_metrics`) serves these
beside the runtime gauges, to a viewer token only (the REST API guards the same facts so); the Prometheus
the control plane runs scrapes that page as job ``controlplane`` with a viewer token of its own, and the
Grafana dashboard in ``deploy/grafana/`` charts them next to the replicas' and the gateways' series. Each
value is read from the object that owns it when Prometheus asks, so the page always agrees with the REST
API; nothing here changes state, and nothing here reads the store: the count of active faults is kept by
:class:`ActiveFaultCount` as the ledger is written. A part the control plane runs without (no autoscaler,
no drills) exports nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chaos.safety import Ledger, LedgerRow, LedgerState
from controlplane.store.database import ACTIVE_FAULT_STATES
from inference.runtime_metrics import NAMESPACE

AUTOSCALER_MODES = ("active", "observe_only", "paused")


class FleetView(Protocol):
    desired_total: int

    def num_ready(self) -> int: ...


class AutoscalerView(Protocol):
    ticks: int
    last: dict[str, Any] | None

    @property
    def mode(self) -> str: ...


class DrillsView(Protocol):
    def is_running(self) -> bool: ...


class ActiveFaultCount:
    """The fault ledger (the store) as the fault manager writes it, counting the faults it holds active
    (registered, injected or failed to revert) as rows are written: a scrape reads a number, not SQLite.

    Seeded with one read of the ledger; after that the only writer is the fault manager it is handed to,
    and each read of the active faults (leftovers, a revert) brings the count back in line with the store.
    """

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._active = {row.id for row in ledger.active_faults()}

    def register_fault(self, kind: str, target: str, params: Mapping[str, Any],
                       revert: Mapping[str, Any]) -> LedgerRow:
        return self._track(self._ledger.register_fault(kind, target, params, revert))

    def mark_fault(self, fault_id: int, state: LedgerState, detail: str = "") -> LedgerRow:
        return self._track(self._ledger.mark_fault(fault_id, state, detail))

    def active_faults(self) -> Sequence[LedgerRow]:
        rows = self._ledger.active_faults()
        self._active = {row.id for row in rows}
        return rows

    def __call__(self) -> int:
        """How many faults the ledger holds active now."""
        return len(self._active)

    def __getattr__(self, name: str) -> Any:
        # The rest is the store's own (its experiment journals, which the chaos API looks for on the
        # fault manager's ledger): this wrapper only counts.
        if name == "_ledger":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._ledger, name)

    def _track(self, row: LedgerRow) -> LedgerRow:
        if row.state in ACTIVE_FAULT_STATES:
            self._active.add(row.id)
        else:
            self._active.discard(row.id)
        return row


@dataclass(slots=True)
class StateSources:
    """What the collector reads; ``active_faults`` counts the faults the ledger holds active now, without
    reading the store (:class:`ActiveFaultCount`): the collector runs on the API's event loop."""

    fleet: FleetView
    autoscaler: AutoscalerView | None = None
    drills: DrillsView | None = None
    active_faults: Callable[[], int] | None = None


class ControlPlaneState(Collector):
    """``llmsre_fleet_*``, ``llmsre_autoscaler_*``, ``llmsre_drill_running`` and ``llmsre_faults_active``."""

    def __init__(self, sources: StateSources) -> None:
        self.sources = sources

    def collect(self) -> Iterable[Metric]:
        s = self.sources
        yield _gauge("fleet_desired_replicas", "Replicas the fleet is asked to run.", s.fleet.desired_total)
        yield _gauge("fleet_ready_replicas", "Replicas ready to serve.", s.fleet.num_ready())
        if s.autoscaler is not None:
            yield from _autoscaler(s.autoscaler)
        if s.drills is not None:
            yield _gauge("drill_running", "1 while a drill runs, else 0.", int(s.drills.is_running()))
        if s.active_faults is not None:
            yield _gauge("faults_active", "Faults injected and not yet reverted.", s.active_faults())


def _autoscaler(autoscaler: AutoscalerView) -> Iterable[Metric]:
    ticks = CounterMetricFamily(f"{NAMESPACE}autoscaler_ticks", "Autoscaler passes (observe, decide, "
                                "apply) since the control plane started.")
    ticks.add_metric([], autoscaler.ticks)
    yield ticks
    mode = GaugeMetricFamily(f"{NAMESPACE}autoscaler_mode", "1 for the autoscaler's current mode.",
                             labels=["mode"])
    for name in AUTOSCALER_MODES:
        mode.add_metric([name], float(autoscaler.mode == name))
    yield mode
    last = autoscaler.last or {}
    if "recommendation" in last:  # absent before the first decision: no made-up number
        yield _gauge("autoscaler_recommended_replicas", "Replicas the last decision recommended, before "
                     "bounds and clamps.", last["recommendation"])
        yield _gauge("autoscaler_final_replicas", "Replicas the last decision settled on, after bounds and "
                     "clamps.", last.get("final", last["recommendation"]))
    drift = (last.get("inputs") or {}).get("profile_drift")
    if drift:  # absent while the replicas are too idle to judge
        yield _gauge("autoscaler_profile_drift_ratio", "The replicas' engine time over what their profile "
                     "predicts for the same steps, at the last decision (1: the profile holds).",
                     drift["ratio"])
        if drift.get("on_cpu") is not None:  # absent when the replicas do not count their steps' CPU time
            yield _gauge("autoscaler_engine_on_cpu_ratio", "The share of the replicas' engine step time on a "
                         "core, at the last decision (below 1: they waited for cores held by other "
                         "processes or replicas, or for the interpreter lock).", drift["on_cpu"])
        if drift.get("waiting_core") is not None:  # absent where the replicas' kernel does not count it
            yield _gauge("autoscaler_engine_waiting_core_ratio", "The share of the replicas' engine step "
                         "time waiting for a core held by other processes or replicas (their run delay), at "
                         "the last decision; the rest not on a core they waited for the interpreter lock.",
                         drift["waiting_core"])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NAMESPACE}{name}", doc, value=value)
