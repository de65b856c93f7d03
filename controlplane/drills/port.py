"""The control plane as the chaos layer needs it: the fleet's replicas as fault targets, and the fleet,
gateway and store as :class:`chaos.drills.DrillPort`.

Fault targets carry the replica's admin token, derived from the fleet's secret and never stored.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos.drills import FaultNotInjected, FleetSample, Timings
from chaos.targets import Target
from controlplane.errors import ControlPlaneError
from controlplane.fleet.models import ensure_bundled_model, is_bundled
from controlplane.fleet.reconcile import Fleet
from controlplane.gateway.config import GatewayConfig
from controlplane.replicas import ReplicaState
from controlplane.store.database import Store

MARKS = "drill_marks"
# Runs a slice experiment from its JSON spec to its end; its record (controlplane.rollouts.experiment).
SliceExperimentRunner = Callable[[Mapping[str, Any], str], Awaitable[dict[str, Any]]]
START_TIME_EVENTS = 50  # the latest replica.ready events that give the measured start time


@dataclass(slots=True, frozen=True)
class ChaosTarget:
    """A replica as the chaos layer sees it."""

    replica_id: str
    zone: str
    pid: int | None
    port: int
    admin_url: str
    admin_token: str | None


def fleet_targets(fleet: Fleet) -> list[ChaosTarget]:
    return [ChaosTarget(e.replica_id, e.zone, e.pid, e.port, e.admin_url, fleet.admin_token(e.replica_id))
            for e in fleet.endpoints() if e.state is not ReplicaState.STOPPED]



class FleetDrillPort:
    """The fleet, gateway and store as :class:`chaos.drills.DrillPort`."""

    def __init__(self, fleet: Fleet, store: Store, *, gateway: GatewayConfig, state_path: Path,
                 inflight: Callable[[], Mapping[str, int]] = dict,
                 refresh_inflight: Callable[[], Awaitable[None]] | None = None,
                 kill_gateway: Callable[[], str] | None = None,
                 slice_experiment: SliceExperimentRunner | None = None) -> None:
        self.fleet, self.store, self.gateway, self.state_path = fleet, store, gateway, state_path
        self._inflight = inflight  # the gateways' streams in flight per replica
        self._refresh_inflight = refresh_inflight  # asks the gateways now (None: the view is always fresh)
        self._kill_gateway = kill_gateway  # the gateway supervisor's kill_one
        self._slice_experiment = slice_experiment  # controlplane.rollouts.experiment's run_to_end

    @property
    def gateway_url(self) -> str:
        return f"http://{self.gateway.host}:{self.gateway.port}"

    def fleet_sample(self) -> FleetSample:
        f = self.fleet
        return FleetSample(time.time(), f.num_ready(), f.desired_total, f.rollout is not None)

    def inflight(self) -> Mapping[str, int]:
        return self._inflight()

    async def refresh_inflight(self) -> None:
        if self._refresh_inflight is not None:
            await self._refresh_inflight()

    def kill_gateway(self) -> str:
        if self._kill_gateway is None:
            raise FaultNotInjected("no gateway process to kill: the gateway runs in this process")
        try:
            return self._kill_gateway()
        except OSError as exc:
            raise FaultNotInjected(f"gateway not killed: {exc}") from exc

    async def run_slice_experiment(self, spec: Mapping[str, Any], by: str) -> dict[str, Any]:
        if self._slice_experiment is None:
            raise FaultNotInjected("slice experiments are not available in this control plane")
        try:
            return await self._slice_experiment(spec, by)
        except (ValueError, TypeError, ControlPlaneError) as exc:
            raise FaultNotInjected(f"slice experiment not started: {exc}") from exc

    def targets(self) -> Sequence[Target]:
        return fleet_targets(self.fleet)

    def timings(self) -> Timings:
        fc, gc = self.fleet.config, self.gateway
        return Timings(replica_start_s=self.replica_start_s(), health_interval_s=fc.health_interval_s,
                       reconcile_interval_s=fc.reconcile_interval_s, stall_timeout_s=gc.stall_timeout_s,
                       first_byte_timeout_s=gc.first_byte_timeout_s,
                       restart_backoff_s=fc.restart_backoff_s, rollout_observe_s=fc.rollout_observe_s,
                       replicas=self.fleet.desired_total)

    def replica_start_s(self) -> float | None:
        """Median spawn-to-ready seconds of the latest replica starts (fleet events)."""
        events = self._events("replica.ready")[-START_TIME_EVENTS:]
        seconds = [float(e.detail["seconds_to_ready"]) for e in events if "seconds_to_ready" in e.detail]
        return round(statistics.median(seconds), 3) if seconds else None

    def start_rollout(self) -> str:
        """Roll out the same weights under a new folder named as the bundled model the fleet serves
        (``default``, ``default-moe``; ``default`` for a fleet serving a model folder), so that clients'
        model name and the greedy tokens stay the same; alternates between two such folders."""
        base = self.state_path / "drills" / "rollout"
        served = self.fleet.model
        name = Path(served).name if Path(served).parent.parent == base else served
        if not is_bundled(name):
            name = "default"
        source = ensure_bundled_model(name, self.state_path)
        assert source is not None  # a bundled model
        folders = []
        for slot in ("a", "b"):
            link = base / slot / name
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(source, target_is_directory=True)
            folders.append(str(link))
        model = folders[1] if served == folders[0] else folders[0]
        self.fleet.start_rollout(model)
        return model

    def resumes_between(self, start_wall: float, end_wall: float) -> int:
        return sum(1 for e in self._events("gateway.resumed") if start_wall <= e.ts <= end_wall)

    def write_marks(self, drill_id: str, n: int) -> list[int]:
        return [self.store.add_record(MARKS, {"drill": drill_id, "n": i}, key=drill_id).id for i in range(n)]

    def count_marks(self, ids: Sequence[int]) -> int:
        return sum(1 for i in ids if self.store.record(i, MARKS) is not None)

    def _events(self, kind: str) -> list[Any]:
        out: list[Any] = []
        since = 0
        while True:
            page = self.store.events(since_id=since, kind_prefix=kind, limit=5000)
            out += page
            if len(page) < 5000:
                return out
            since = page[-1].id


