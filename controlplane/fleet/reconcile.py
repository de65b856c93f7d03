"""The fleet: the desired set of replicas (count per zone, model) reconciled against what runs.

Each reconcile pass observes (process alive? ready?), decides what to change (restart a crashed replica
after its backoff, spawn or drain to reach the desired count per zone, take the next step of a rolling
update) and applies it through a :class:`ReplicaBackend`. Every transition is an event in the store and
the replica registry in the store is kept current, so a control plane restarted after ``kill -9`` can
adopt (or stop) every replica the previous one left.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import httpx

from controlplane.fleet.backends.base import ReplicaBackend, ReplicaHandle, ReplicaSpec
from controlplane.fleet.config import FleetConfig
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.store.database import ReplicaRow

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
DESIRED_KEY = "fleet.desired"  # what the operator asked for survives a crash of the control plane
UNREADY_AFTER_FAILURES = 3  # consecutive failed readiness probes before a ready replica counts as unready


class FleetStore(Protocol):
    """The part of the store the fleet writes (see controlplane.store.database)."""

    def add_event(self, kind: str, subject: str, detail: dict[str, Any]) -> Any: ...

    def upsert_replica(self, row: Any) -> None: ...

    def replicas(self) -> list[Any]: ...

    def delete_replica(self, replica_id: str) -> object: ...

    def kv_put(self, key: str, value: Any) -> None: ...

    def kv_get(self, key: str, default: Any = None) -> Any: ...


class FleetError(Exception):
    """A fleet request that cannot be carried out (unknown replica, rollout already running...)."""


@dataclass
class ManagedReplica:
    spec: ReplicaSpec
    handle: ReplicaHandle | None
    state: ReplicaState
    started_at: float
    restarts: int = 0
    crash_times: list[float] = field(default_factory=list)
    restart_at: float | None = None  # when a crashed replica is due to be restarted
    ready_failures: int = 0
    drain_started: float | None = None

    @property
    def endpoint(self) -> ReplicaEndpoint:
        pid = self.handle.pid if self.handle else None
        return ReplicaEndpoint(self.spec.replica_id, self.spec.zone, self.spec.host, self.spec.port,
                               self.state, self.spec.model, pid, self.spec.generation)


@dataclass(slots=True)
class Rollout:
    model: str
    generation: int
    previous_model: str
    previous_generation: int
    started_at: float
    surge: str | None = None  # the new replica being waited on
    surge_started: float | None = None
    surge_ready_at: float | None = None  # when it became ready: it is watched for errors from then on


def replica_admin_token(secret: bytes, replica_id: str) -> str:
    """Per-replica admin token derived from the control plane's secret, so an adopted replica is reachable."""
    return hmac.new(secret, replica_id.encode(), hashlib.sha256).hexdigest()


def load_or_create_secret(path: Path) -> bytes:
    if path.exists():
        return path.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(32)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(secret)
    tmp.chmod(0o600)
    tmp.replace(path)
    return secret


def zone_targets(total: int, zones: list[str]) -> dict[str, int]:
    """Spread ``total`` replicas over zones, the first zones taking the remainder."""
    base, extra = divmod(total, len(zones))
    return {zone: base + (1 if i < extra else 0) for i, zone in enumerate(zones)}


class Fleet:
    def __init__(self, config: FleetConfig, backend: ReplicaBackend, store: FleetStore, *, secret: bytes,
                 clock: Callable[[], float] = time.monotonic,
                 ready_probe: Callable[[ReplicaEndpoint], Any] | None = None,
                 error_rate: Callable[[str], float | None] = lambda _: None,
                 reserved_ports: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.reserved_ports = reserved_ports  # the control plane's own listeners: never given to a replica
        self.backend = backend
        self.store = store
        self.secret = secret
        self.clock = clock
        self.replicas: dict[str, ManagedReplica] = {}
        self.desired_total = config.replicas
        self.model = config.model
        self.generation = 0
        self.rollout: Rollout | None = None
        self.stopping = False
        self._client = httpx.AsyncClient(timeout=2.0, trust_env=False)
        self._probe = ready_probe or self._probe_ready
        self.error_rate = error_rate  # a replica's recent 5xx share, from telemetry (None: unknown)
        self._task: asyncio.Task[None] | None = None
        self._last_health_probe = float("-inf")
        self._listeners: list[Callable[[list[ReplicaEndpoint]], None]] = []

    # ---- views ---------------------------------------------------------------------------------
    def endpoints(self) -> list[ReplicaEndpoint]:
        return [r.endpoint for r in self.replicas.values()]

    def num_ready(self) -> int:
        return sum(1 for r in self.replicas.values() if r.state is ReplicaState.READY)

    def admin_token(self, replica_id: str) -> str:
        return replica_admin_token(self.secret, replica_id)

    def on_change(self, listener: Callable[[list[ReplicaEndpoint]], None]) -> None:
        """Called with the endpoints after every pass that changed a state (Prometheus targets)."""
        self._listeners.append(listener)

    # ---- requests ------------------------------------------------------------------------------
    def scale(self, replicas: int) -> None:
        if replicas < 0:
            raise FleetError(f"replicas: must be >= 0, got {replicas}")
        self._event("fleet.scaled", "fleet", {"from": self.desired_total, "to": replicas})
        self.desired_total = replicas
        self._persist_desired()

    def restart(self, replica_id: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None:
            raise FleetError(f"no replica {replica_id!r}")
        self._event("replica.restart_requested", replica_id, {})
        if replica.handle is not None:
            self.backend.kill(replica.handle)
        self._spawn(replica.spec, restarts=replica.restarts + 1, crash_times=replica.crash_times)

    def start_rollout(self, model: str) -> Rollout:
        if self.rollout is not None:
            raise FleetError(f"a rollout to {self.rollout.model} is already in progress")
        if model == self.model:
            raise FleetError(f"the fleet already runs {model}")
        self.rollout = Rollout(model, self.generation + 1, self.model, self.generation, self.clock())
        self._event("rollout.started", "fleet", {"model": model, "generation": self.generation + 1})
        self._persist_desired()
        return self.rollout

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self.adopt_or_clean()
        self._task = asyncio.create_task(self._loop(), name="fleet-reconcile")

    async def stop(self, *, drain: bool = True) -> None:
        """Drain (or kill) every replica and wait until none runs."""
        self.stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for replica in self.replicas.values():
            if replica.handle is not None and self.backend.is_running(replica.handle):
                (self.backend.drain if drain else self.backend.kill)(replica.handle)
        deadline = self.clock() + (self.config.drain_timeout_s + 5 if drain else 5)
        while self.clock() < deadline and any(r.handle and self.backend.is_running(r.handle)
                                              for r in self.replicas.values()):
            await asyncio.sleep(0.1)
        for replica in list(self.replicas.values()):
            if replica.handle is not None:
                if self.backend.is_running(replica.handle):
                    self.backend.kill(replica.handle)
                self._forget(replica)
            self._set_state(replica, ReplicaState.STOPPED)
            self.store.delete_replica(replica.spec.replica_id)
        await self._client.aclose()

    async def _loop(self) -> None:
        while not self.stopping:
            try:
                await self.reconcile()
            except Exception:  # a failed pass is logged and retried; the loop must not die
                logger.exception("fleet reconcile pass failed")
            await asyncio.sleep(self.config.reconcile_interval_s)

    # ---- one reconcile pass --------------------------------------------------------------------
    async def reconcile(self) -> None:
        before = {rid: r.state for rid, r in self.replicas.items()}
        self._observe_exits()
        await self._observe_readiness()
        self._restart_due()
        self._step_rollout()
        self._converge_counts()
        self._finish_drains()
        after = {rid: r.state for rid, r in self.replicas.items()}
        if before != after:
            endpoints = self.endpoints()
            for listener in self._listeners:
                listener(endpoints)

    def _observe_exits(self) -> None:
        now = self.clock()
        for replica in self.replicas.values():
            if replica.state in (ReplicaState.CRASHED, ReplicaState.STOPPED, ReplicaState.DRAINING):
                continue
            if replica.handle is not None and self.backend.is_running(replica.handle):
                continue
            status = self.backend.exit_status(replica.handle) if replica.handle else None
            window = self.config.crash_loop_window_s
            replica.crash_times = [t for t in replica.crash_times if now - t < window]
            replica.crash_times.append(now)
            delay = min(self.config.restart_backoff_s * 2 ** (len(replica.crash_times) - 1),
                        self.config.restart_backoff_max_s)
            replica.restart_at = now + delay
            self._set_state(replica, ReplicaState.CRASHED, {"exit_status": status, "restart_in_s": delay})
            if len(replica.crash_times) >= self.config.crash_loop_restarts:
                self._event("replica.crash_loop", replica.spec.replica_id,
                            {"crashes": len(replica.crash_times), "window_s": window})

    async def _observe_readiness(self) -> None:
        """Starting replicas every pass (to route to them as soon as they are ready); the others every
        ``health_interval_s``, since each /ready runs a forward pass on the replica."""
        now = self.clock()
        health_due = now - self._last_health_probe >= self.config.health_interval_s
        if health_due:
            self._last_health_probe = now
        probed = [r for r in self.replicas.values() if r.state is ReplicaState.STARTING or (
            health_due and r.state in (ReplicaState.READY, ReplicaState.UNREADY))]
        results = await asyncio.gather(*(self._probe(r.endpoint) for r in probed), return_exceptions=True)
        now = self.clock()  # after the probes, which take time
        for replica, ok in zip(probed, results):
            if ok is True:
                replica.ready_failures = 0
                if replica.state is not ReplicaState.READY:
                    waited = now - replica.started_at
                    self._set_state(replica, ReplicaState.READY, {"seconds_to_ready": round(waited, 3)})
                continue
            replica.ready_failures += 1
            if replica.state is ReplicaState.READY and replica.ready_failures >= UNREADY_AFTER_FAILURES:
                self._set_state(replica, ReplicaState.UNREADY, {"failures": replica.ready_failures})

    def _restart_due(self) -> None:
        now = self.clock()
        for replica in list(self.replicas.values()):
            if replica.state is ReplicaState.CRASHED and replica.restart_at is not None \
                    and now >= replica.restart_at:
                if replica.handle is not None:
                    self._forget(replica)
                self._event("replica.restarting", replica.spec.replica_id, {"restarts": replica.restarts + 1})
                self._spawn(self._bindable(replica.spec), restarts=replica.restarts + 1,
                            crash_times=replica.crash_times)

    def _converge_counts(self) -> None:
        if self.rollout is not None:
            return  # the rollout owns the counts until it ends
        targets = zone_targets(self.desired_total, self.config.zones)
        for zone, want in targets.items():
            live = [r for r in self.replicas.values() if r.spec.zone == zone and r.state not in
                    (ReplicaState.DRAINING, ReplicaState.STOPPED)]
            for _ in range(want - len(live)):
                self._spawn(self._new_spec(zone, self.model, self.generation))
            for replica in self._drain_candidates(live)[:max(len(live) - want, 0)]:
                self._start_drain(replica, "scale down")
        for replica in list(self.replicas.values()):
            if replica.spec.zone not in targets and replica.state not in (ReplicaState.DRAINING,
                                                                          ReplicaState.STOPPED):
                self._start_drain(replica, "zone removed")

    def _drain_candidates(self, live: list[ManagedReplica]) -> list[ManagedReplica]:
        """Not-ready replicas first, then the newest."""
        return sorted(live, key=lambda r: (r.state is ReplicaState.READY, -r.started_at))

    def _finish_drains(self) -> None:
        now = self.clock()
        for replica in list(self.replicas.values()):
            if replica.state is not ReplicaState.DRAINING or replica.handle is None:
                continue
            overdue = replica.drain_started is not None and \
                now - replica.drain_started > self.config.drain_timeout_s + 5
            if overdue and self.backend.is_running(replica.handle):
                self.backend.kill(replica.handle)
            if not self.backend.is_running(replica.handle):
                self._forget(replica)
                self._set_state(replica, ReplicaState.STOPPED)
                del self.replicas[replica.spec.replica_id]
                self.store.delete_replica(replica.spec.replica_id)

    # ---- rolling update ------------------------------------------------------------------------
    def _step_rollout(self) -> None:
        ro = self.rollout
        if ro is None:
            return
        if ro.surge is not None:
            self._watch_surge(ro)
            return
        old = [r for r in self.replicas.values() if r.spec.generation != ro.generation
               and r.state not in (ReplicaState.DRAINING, ReplicaState.STOPPED)]
        if not old:
            self.model, self.generation, self.rollout = ro.model, ro.generation, None
            self._event("rollout.completed", "fleet", {"model": ro.model, "generation": ro.generation})
            self._persist_desired()
            return
        spec = self._new_spec(old[0].spec.zone, ro.model, ro.generation)
        self._spawn(spec)
        ro.surge, ro.surge_started = spec.replica_id, self.clock()
        self._event("rollout.step", spec.replica_id, {"replacing": old[0].spec.replica_id})

    def _watch_surge(self, ro: Rollout) -> None:
        assert ro.surge is not None and ro.surge_started is not None
        surge = self.replicas.get(ro.surge)
        now = self.clock()
        if surge is not None and surge.state is ReplicaState.READY:
            if ro.surge_ready_at is None:
                ro.surge_ready_at = now
            worse = self._errs_more_than_old(ro, surge)
            if worse is not None:
                self._roll_back(ro, worse)
            elif now - ro.surge_ready_at >= self.config.rollout_observe_s:
                self._replace_old(ro, surge)
            return
        failed = surge is None or surge.state is ReplicaState.CRASHED
        if failed or now - ro.surge_started > self.config.ready_timeout_s:
            self._roll_back(ro, "new replica crashed" if failed else "new replica not ready in time")

    def _errs_more_than_old(self, ro: Rollout, surge: ManagedReplica) -> str | None:
        new_rate = self.error_rate(surge.spec.replica_id)
        old_rates = [r for r in (self.error_rate(o.spec.replica_id) for o in self.replicas.values()
                                 if o.spec.generation != ro.generation and o.state is ReplicaState.READY)
                     if r is not None]
        if new_rate is None:
            return None
        baseline = max(old_rates, default=0.0)
        if new_rate > baseline + self.config.rollout_max_error_increase:
            return f"new replica errors on {new_rate:.1%} of requests, the old ones on {baseline:.1%}"
        return None

    def _replace_old(self, ro: Rollout, surge: ManagedReplica) -> None:
        zone_old = [r for r in self.replicas.values() if r.spec.zone == surge.spec.zone
                    and r.spec.generation != ro.generation and r.state is not ReplicaState.DRAINING]
        if zone_old:
            self._start_drain(zone_old[0], f"replaced by {surge.spec.replica_id}")
        ro.surge, ro.surge_ready_at = None, None

    def _roll_back(self, ro: Rollout, reason: str) -> None:
        for replica in list(self.replicas.values()):
            if replica.spec.generation == ro.generation and replica.state is not ReplicaState.DRAINING:
                self._start_drain(replica, "rollback")
        self.rollout = None
        self._event("rollout.rolled_back", "fleet", {"model": ro.model, "reason": reason})
        self._persist_desired()

    # ---- adoption after a restart of the control plane -----------------------------------------
    def restore_desired(self) -> None:
        """Take back the desired state an earlier control plane acknowledged (scale, model, rollout)."""
        saved = self.store.kv_get(DESIRED_KEY)
        if not saved:
            return
        self.desired_total, self.model = saved["replicas"], saved["model"]
        self.generation = saved["generation"]
        ro = saved.get("rollout")
        if ro:
            self.rollout = Rollout(ro["model"], ro["generation"], self.model, self.generation, self.clock())
        self._event("fleet.restored", "fleet", saved)

    def _persist_desired(self) -> None:
        ro = self.rollout
        self.store.kv_put(DESIRED_KEY, {
            "replicas": self.desired_total, "model": self.model, "generation": self.generation,
            "rollout": None if ro is None else {"model": ro.model, "generation": ro.generation}})

    def adopt_or_clean(self) -> None:
        self.restore_desired()
        for row in self.store.replicas():
            spec = self._new_spec(row.zone, row.model, row.generation, replica_id=row.replica_id,
                                  port=row.port)
            handle = self.backend.adopt(spec, row.pid)
            if handle is None:
                self.store.delete_replica(row.replica_id)
                self._event("replica.gone", row.replica_id, {"pid": row.pid})
                continue
            if self.config.on_restart == "stop":
                self.backend.kill(handle)
                self.store.delete_replica(row.replica_id)
                self._event("replica.orphan_stopped", row.replica_id, {"pid": row.pid})
                continue
            replica = ManagedReplica(spec, handle, ReplicaState.STARTING, self.clock(), row.restarts)
            self.replicas[spec.replica_id] = replica
            self._event("replica.adopted", spec.replica_id, {"pid": row.pid, "port": row.port})
            self._save(replica)

    # ---- mechanics -----------------------------------------------------------------------------
    def _new_spec(self, zone: str, model: str, generation: int, *, replica_id: str | None = None,
                  port: int | None = None) -> ReplicaSpec:
        rid = replica_id or self._next_id(zone)
        return ReplicaSpec(rid, zone, HOST, port or self._free_port(), model, generation,
                           self.admin_token(rid), self.config.replica_threads, self.config.max_num_seqs,
                           self.config.drain_timeout_s)

    def _next_id(self, zone: str) -> str:
        taken = {rid for rid in self.replicas}
        n = 1
        while f"{zone}-{n}" in taken:
            n += 1
        return f"{zone}-{n}"

    def _free_port(self) -> int:
        used = {r.spec.port for r in self.replicas.values()} | self.reserved_ports
        port = self.config.base_port
        while port in used or not _port_free(port):
            port += 1
        return port

    def _bindable(self, spec: ReplicaSpec) -> ReplicaSpec:
        """``spec``, or a copy on a free port when something else now listens on its port: a replica that
        crashed because its port was taken would otherwise crash the same way at every restart."""
        if spec.port not in self.reserved_ports and _port_free(spec.port):
            return spec
        moved = replace(spec, port=self._free_port())
        self._event("replica.port_moved", spec.replica_id, {"from": spec.port, "to": moved.port})
        return moved

    def _spawn(self, spec: ReplicaSpec, *, restarts: int = 0, crash_times: list[float] | None = None) -> None:
        handle = self.backend.spawn(spec)
        replica = ManagedReplica(spec, handle, ReplicaState.STARTING, self.clock(), restarts,
                                 list(crash_times or []))
        self.replicas[spec.replica_id] = replica
        self._event("replica.spawned", spec.replica_id, {"pid": handle.pid, "port": spec.port,
                                                         "zone": spec.zone, "model": spec.model,
                                                         "generation": spec.generation})
        self._save(replica)

    def _start_drain(self, replica: ManagedReplica, reason: str) -> None:
        if replica.handle is not None and self.backend.is_running(replica.handle):
            self.backend.drain(replica.handle)
        replica.drain_started = self.clock()
        self._set_state(replica, ReplicaState.DRAINING, {"reason": reason})

    def _forget(self, replica: ManagedReplica) -> None:
        forget = getattr(self.backend, "forget", None)
        if forget is not None and replica.handle is not None:
            forget(replica.handle)

    def _set_state(self, replica: ManagedReplica, state: ReplicaState,
                   detail: dict[str, Any] | None = None) -> None:
        if replica.state is state:
            return
        logger.info("[%s] %s -> %s %s", replica.spec.replica_id, replica.state.value, state.value,
                    detail or "")
        replica.state = state
        self._event(f"replica.{state.value}", replica.spec.replica_id, detail or {})
        if state is not ReplicaState.STOPPED:
            self._save(replica)

    def _save(self, replica: ManagedReplica) -> None:
        s = replica.spec
        self.store.upsert_replica(ReplicaRow(
            replica_id=s.replica_id, zone=s.zone, host=s.host, port=s.port,
            pid=replica.handle.pid if replica.handle else None, state=replica.state, model=s.model,
            generation=s.generation, started_at=time.time(), restarts=replica.restarts))

    def _event(self, kind: str, subject: str, detail: dict[str, Any]) -> None:
        self.store.add_event(kind, subject, detail)

    async def _probe_ready(self, endpoint: ReplicaEndpoint) -> bool:
        try:
            response = await self._client.get(f"{endpoint.base_url}/ready")
        except httpx.HTTPError:
            return False
        return response.status_code == 200


def _port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now. SO_REUSEADDR as uvicorn sets it: connections in
    TIME_WAIT from a replica that just exited do not count as taken, a listening socket does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True
