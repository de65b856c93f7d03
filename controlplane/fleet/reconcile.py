"""The fleet: the desired set of replicas (count per zone, model) reconciled against what runs.

Each reconcile pass observes (process alive? ready? port taken?), plans what to change with the pure
:func:`controlplane.fleet.plan.plan_pass` (restart a crashed replica after its backoff, spawn or drain to
reach the desired count per zone, take the next step of a rolling update) and applies that plan once
through a :class:`ReplicaBackend`. Every transition is an event in the store and the replica registry in
the store is kept current (``fleet/registry.py``), so a control plane restarted after ``kill -9`` can adopt
(or stop) every replica the previous one left; the nodes a cluster backend places replicas on are tracked
in ``fleet/nodes.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx

from controlplane.errors import Conflict, ControlPlaneError, NotFound, Refused
from controlplane.fleet.backends.base import NodeState, ReplicaBackend, ReplicaSpec
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.models import served_model_name
from controlplane.fleet.nodes import Nodes
from controlplane.fleet.plan import (
    Action,
    Canary,
    CompleteRollout,
    Desired,
    Drain,
    Kill,
    MarkCrashed,
    MarkReady,
    MarkUnready,
    Observation,
    ObservedReplica,
    Plan,
    RecordProbe,
    Remove,
    ReportCrashLoop,
    Restart,
    RollBack,
    Rollout,
    Spawn,
    StepRollout,
    plan_pass,
)
from controlplane.fleet.ports import HOST, port_free
from controlplane.fleet.registry import (
    DESIRED_KEY,
    UNPLACED,
    FleetStore,
    ManagedReplica,
    desired_record,
    persisted,
    replica_admin_token,
    replica_row,
)
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from inference.config import TracingConfig

logger = logging.getLogger(__name__)



class FleetError(ControlPlaneError):
    """A fleet request that cannot be carried out; the subclasses say why."""


class FleetRefused(FleetError, Refused):
    """A bad request, such as a negative replica count."""


class FleetConflict(FleetError, Conflict):
    """The request contradicts the fleet's state (a rollout already running, the model already served)."""


class UnknownReplica(FleetError, NotFound):
    """No replica has this id."""


class Fleet:
    def __init__(self, config: FleetConfig, backend: ReplicaBackend, store: FleetStore, *, secret: bytes,
                 clock: Callable[[], float] = time.monotonic,
                 ready_probe: Callable[[ReplicaEndpoint], Any] | None = None,
                 error_rate: Callable[[str], float | None] = lambda _: None,
                 reserved_ports: frozenset[int] = frozenset(),
                 tracing: TracingConfig | None = None,
                 prepare_model: Callable[[str], object] | None = None) -> None:
        self.config = config
        self.tracing = tracing or TracingConfig()  # trace export, passed to every replica it starts
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
        self._nodes = Nodes(config, self._event)
        # Builds a bundled model where the replicas will find it (None: the replicas do, as on Ray nodes).
        self.prepare_model = prepare_model
        self._prepared: set[str] = set()
        self.canary: Canary | None = None  # a canary release's replicas, beside the fleet

    # ---- views ---------------------------------------------------------------------------------
    def endpoints(self) -> list[ReplicaEndpoint]:
        return [r.endpoint for r in self.replicas.values()]

    def num_ready(self) -> int:
        return sum(1 for r in self.replicas.values() if r.state is ReplicaState.READY)

    def admin_token(self, replica_id: str) -> str:
        return replica_admin_token(self.secret, replica_id)

    def nodes(self) -> list[NodeState]:
        """The nodes replicas run on (none locally): the live ones, and each lost one not yet replaced."""
        return self._nodes.listed()

    @property
    def zones_down(self) -> frozenset[str]:
        """Zones of the fleet without a live node (never any for local processes)."""
        return self._nodes.zones_down

    def on_change(self, listener: Callable[[list[ReplicaEndpoint]], None]) -> None:
        """Called with the endpoints after every pass that changed a state (Prometheus targets)."""
        self._listeners.append(listener)

    # ---- requests ------------------------------------------------------------------------------
    def scale(self, replicas: int) -> None:
        if replicas < 0:
            raise FleetRefused(f"replicas: must be >= 0, got {replicas}", param="replicas")
        self._event("fleet.scaled", "fleet", {"from": self.desired_total, "to": replicas})
        self.desired_total = replicas
        self._persist_desired()

    def restart(self, replica_id: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None:
            raise UnknownReplica(f"no replica {replica_id!r}", subject=replica_id)
        self._event("replica.restart_requested", replica_id, {})
        if replica.handle is not None:
            self.backend.kill(replica.handle)
        self._spawn(replica.spec, restarts=replica.restarts + 1, crash_times=replica.crash_times)

    def start_canary(self, version: str, model: str, replicas: int = 1) -> Canary:
        """Replicas of ``model`` beside the fleet, labelled ``version`` (traffic: the gateways' split)."""
        if self.canary is not None or self.rollout is not None:
            raise FleetConflict("a canary or a rollout is already in progress")
        self.canary = Canary(version, model, replicas)
        self._event("canary.started", "fleet", {"version": version, "model": model, "replicas": replicas})
        self._persist_desired()
        return self.canary

    def end_canary(self) -> None:  # its replicas drain in the next pass
        if self.canary is not None:
            self._event("canary.ended", "fleet", {"version": self.canary.version})
            self.canary = None
            self._persist_desired()

    def start_rollout(self, model: str) -> Rollout:
        if self.rollout is not None:
            raise FleetConflict(f"a rollout to {self.rollout.model} is already in progress")
        if model == self.model and self.canary is None:
            raise FleetConflict(f"the fleet already runs {model}", param="model")
        self.rollout = Rollout(model, self.generation + 1, self.model, self.generation, self.clock())
        self._event("rollout.started", "fleet", {"model": model, "generation": self.generation + 1})
        self._persist_desired()
        return self.rollout

    async def _prepare_models(self) -> None:
        """Build each model once before its first replica starts (not when adopted replicas run it: their
        first pass must not wait); a failed build is logged, and each replica then tries itself."""
        prepare, running = self.prepare_model, {r.spec.model for r in self.replicas.values()}
        for model in (self.model, *(x.model for x in (self.rollout, self.canary) if x is not None)):
            if prepare is not None and model not in self._prepared | running:
                self._prepared.add(model)
                try:
                    await asyncio.to_thread(prepare, model)
                except Exception:
                    logger.exception("could not build the model %s before starting its replicas", model)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        prepare = getattr(self.backend, "prepare", None)  # a fork server's imports: before the first spawn
        if prepare is not None:
            await asyncio.to_thread(prepare)
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
        close = getattr(self.backend, "close", None)  # a cluster connection: release what it holds
        if close is not None:
            await asyncio.to_thread(close)
        await self._client.aclose()

    async def _loop(self) -> None:
        while not self.stopping:
            try:
                await self._prepare_models()
                await self.reconcile()
            except Exception:  # a failed pass is logged and retried; the loop must not die
                logger.exception("fleet reconcile pass failed")
            await asyncio.sleep(self.config.reconcile_interval_s)

    # ---- one reconcile pass: observe, plan, apply once -------------------------------------------
    @property
    def desired(self) -> Desired:
        return Desired(self.desired_total, self.model, self.generation, self.rollout, self.canary)

    async def reconcile(self) -> None:
        before = self.endpoints()
        self._observe_nodes()
        self._locate()
        readiness = await self._probe_readiness()
        # From here on nothing awaits: an API call cannot change the fleet between observation and apply.
        plan = plan_pass(self._observe(readiness), self.desired, self.config)
        self._apply(plan)
        endpoints = self.endpoints()
        if before != endpoints:
            for listener in self._listeners:
                listener(endpoints)

    def _observe_nodes(self) -> None:
        """The backend's nodes, for a backend that places replicas (see :class:`Nodes`)."""
        if self.backend.places_replicas:
            self._nodes.observe(self.backend.nodes())

    def _locate(self) -> None:
        """Where each placed replica listens, from the backend; a new place is saved (adoption after a
        crash reads it) and published (the gateways and Prometheus follow ``endpoints()``)."""
        if not self.backend.places_replicas:
            return
        for rid, replica in self.replicas.items():
            location = self.backend.location(replica.handle) if replica.handle is not None else None
            if location is None or location == replica.location:
                continue
            replica.location = location
            if location.node_id:
                self._nodes.placed(rid, location.node_id)
            replica.spec = replace(replica.spec, host=location.host, port=location.port)
            self._event("replica.placed", rid, {"node": location.node, "node_id": location.node_id,
                                                "host": location.host, "port": location.port})
            self._save(replica)

    def _located(self, replica: ManagedReplica) -> bool:
        """Whether the replica's address is known (always, for local processes)."""
        return not self.backend.places_replicas or replica.location is not None

    async def _probe_readiness(self) -> dict[str, bool]:
        """/ready of starting replicas every pass (to route to them as soon as they are ready); of the
        others every ``health_interval_s``, since each /ready runs a forward pass on the replica."""
        now = self.clock()
        health_due = now - self._last_health_probe >= self.config.health_interval_s
        if health_due:
            self._last_health_probe = now
        probed = [r for r in self.replicas.values() if (r.state is ReplicaState.STARTING or (
            health_due and r.state in (ReplicaState.READY, ReplicaState.UNREADY)))
            and self._running(r) and self._located(r)]
        results = await asyncio.gather(*(self._probe(r.endpoint) for r in probed), return_exceptions=True)
        # a replica restarted by an API call while the probes ran is not the one that was probed
        return {r.spec.replica_id: ok is True for r, ok in zip(probed, results)
                if self.replicas.get(r.spec.replica_id) is r}

    def _observe(self, readiness: dict[str, bool]) -> Observation:
        return Observation(
            now=self.clock(), reserved_ports=self.reserved_ports,
            replicas=tuple(self._observe_one(r, readiness.get(rid)) for rid, r in self.replicas.items()),
            error_rates={rid: self.error_rate(rid) for rid in self.replicas} if self._surge_serves(readiness)
            else {}, zones_down=self._nodes.zones_down)

    def _surge_serves(self, readiness: dict[str, bool]) -> bool:
        """Whether a rollout's new replica serves (or starts to): only then are error rates queried."""
        surge = self.replicas.get(self.rollout.surge or "") if self.rollout is not None else None
        return surge is not None and (surge.state is ReplicaState.READY or
                                      readiness.get(surge.spec.replica_id, False))

    def _observe_one(self, r: ManagedReplica, is_ready: bool | None) -> ObservedReplica:
        running = self._running(r)
        exit_status = self.backend.exit_status(r.handle) if r.handle is not None and not running else None
        return ObservedReplica(
            r.spec.replica_id, r.spec.zone, r.spec.port, r.spec.model, r.spec.generation, r.state,
            r.started_at, running, exit_status, is_ready,
            port_free=running or r.state in (ReplicaState.DRAINING, ReplicaState.STOPPED)
            or self.backend.places_replicas or port_free(r.spec.port), restarts=r.restarts,
            crash_times=tuple(r.crash_times), restart_at=r.restart_at, ready_failures=r.ready_failures,
            drain_started=r.drain_started, version=r.spec.version)

    def _running(self, replica: ManagedReplica) -> bool:
        return replica.handle is not None and self.backend.is_running(replica.handle)

    def _apply(self, plan: Plan) -> None:
        """The plan, once: the desired state it leaves (saved when that changed), then each action in
        order. A failed action is logged and kept as a ``fleet.action_failed`` event; the others still
        happen, and the next pass plans again from what it finds."""
        was = persisted(self.desired)
        self.model, self.generation, self.rollout = plan.desired.model, plan.desired.generation, \
            plan.desired.rollout
        if persisted(plan.desired) != was:
            self._persist_desired()
        for action in plan.actions:
            subject = getattr(action, "replica_id", "fleet")
            logger.debug("[%s] %s", subject, action)
            try:
                self._apply_one(action)
            except Exception as exc:  # one failed action (a spawn, a signal) must not stop the others
                logger.exception("[%s] %s failed", subject, type(action).__name__)
                self._event("fleet.action_failed", subject, {"action": type(action).__name__,
                                                             "error": f"{type(exc).__name__}: {exc}"})

    def _apply_one(self, action: Action) -> None:
        match action:
            case MarkCrashed(rid, status, crashes, restart_at, delay):
                replica = self.replicas[rid]
                replica.crash_times, replica.restart_at = list(crashes), restart_at
                self._set_state(replica, ReplicaState.CRASHED, {"exit_status": status, "restart_in_s": delay})
            case ReportCrashLoop(rid, crashes, window):
                self._event("replica.crash_loop", rid, {"crashes": crashes, "window_s": window})
            case RecordProbe(rid, failures):
                self.replicas[rid].ready_failures = failures
            case MarkReady(rid, waited):
                self._set_state(self.replicas[rid], ReplicaState.READY, {"seconds_to_ready": waited})
            case MarkUnready(rid, failures):
                self._set_state(self.replicas[rid], ReplicaState.UNREADY, {"failures": failures})
            case Restart(rid, restarts, move_port):
                self._restart_crashed(self.replicas[rid], restarts, move_port=move_port)
            case Spawn(rid, zone, model, generation, _, version):
                self._spawn(self._new_spec(zone, model, generation, replica_id=rid, version=version))
            case Drain(rid, reason):
                self._start_drain(self.replicas[rid], reason)
            case Kill(rid):
                self._kill(self.replicas[rid])
            case Remove(rid):
                self._remove(self.replicas[rid])
            case StepRollout(surge, replacing):
                self._event("rollout.step", surge, {"replacing": replacing})
            case CompleteRollout(model, generation):
                self._event("rollout.completed", "fleet", {"model": model, "generation": generation})
            case RollBack(model, reason):
                self._event("rollout.rolled_back", "fleet", {"model": model, "reason": reason})

    def _restart_crashed(self, replica: ManagedReplica, restarts: int, *, move_port: bool) -> None:
        if replica.handle is not None:
            self._forget(replica)
        self._event("replica.restarting", replica.spec.replica_id, {"restarts": restarts})
        spec = self._move_port(replica.spec) if move_port else replica.spec
        self._spawn(spec, restarts=restarts, crash_times=replica.crash_times)

    def _kill(self, replica: ManagedReplica) -> None:
        if replica.handle is not None and self.backend.is_running(replica.handle):
            self.backend.kill(replica.handle)

    def _remove(self, replica: ManagedReplica) -> None:
        self._nodes.forget(replica.spec.replica_id)
        self._forget(replica)
        self._set_state(replica, ReplicaState.STOPPED)
        del self.replicas[replica.spec.replica_id]
        self.store.delete_replica(replica.spec.replica_id)

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
        if canary := saved.get("canary"):
            self.canary = Canary(canary["version"], canary["model"], canary["replicas"])
        self._event("fleet.restored", "fleet", saved)

    def _persist_desired(self) -> None:
        self.store.kv_put(DESIRED_KEY, desired_record(self.desired))

    def adopt_or_clean(self) -> None:
        self.restore_desired()
        for row in self.store.replicas():
            spec = replace(self._new_spec(row.zone, row.model, row.generation, replica_id=row.replica_id,
                                          port=row.port, version=row.version),
                           host="" if row.host == UNPLACED else row.host)
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
            self._event("replica.adopted", spec.replica_id, {"pid": row.pid, "host": row.host,
                                                             "port": row.port})
            self._save(replica)
        sweep = getattr(self.backend, "sweep", None)  # replicas of ours no row names (a crash mid-spawn)
        if sweep is not None:
            for replica_id in sweep(keep=set(self.replicas)):
                self._event("replica.orphan_stopped", replica_id, {"reason": "not in the store"})

    # ---- mechanics -----------------------------------------------------------------------------
    def _new_spec(self, zone: str, model: str, generation: int, *, replica_id: str,
                  port: int | None = None, version: str = "") -> ReplicaSpec:
        host = "" if self.backend.places_replicas else HOST  # placed: the backend says where, later
        served = served_model_name(self.model) if version else ""  # a canary answers to the fleet's name
        return ReplicaSpec(replica_id, zone, host, port or self._free_port(), model, generation,
                           self.admin_token(replica_id), self.config.replica_threads,
                           self.config.max_num_seqs, self.config.drain_timeout_s, self.tracing, version,
                           served, cpu_decode_kernel=self.config.cpu_decode_kernel,
                           packed_weights=self.config.packed_weights,
                           cpu_limit=self.config.replica_cpu_limit)

    def _free_port(self) -> int:
        used = {r.spec.port for r in self.replicas.values()} | self.reserved_ports
        port = self.config.base_port
        while port in used or not port_free(port):
            port += 1
        return port

    def _move_port(self, spec: ReplicaSpec) -> ReplicaSpec:
        """A copy of ``spec`` on a free port: a replica that crashed because its port was taken would
        otherwise crash the same way at every restart."""
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
        self.store.upsert_replica(replica_row(replica))

    def _event(self, kind: str, subject: str, detail: dict[str, Any]) -> None:
        self.store.add_event(kind, subject, detail)

    async def _probe_ready(self, endpoint: ReplicaEndpoint) -> bool:
        try:
            response = await self._client.get(f"{endpoint.base_url}/ready")
        except httpx.HTTPError:
            return False
        return response.status_code == 200
