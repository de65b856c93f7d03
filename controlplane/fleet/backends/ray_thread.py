"""The one thread that talks to Ray for the Ray backend: every cluster call, and what it last saw.

Where it sits: under :class:`~controlplane.fleet.backends.ray.RayBackend`, whose verbs (the fleet's) only
queue work here (:meth:`RayThread.submit`, or :meth:`RayThread.call` to wait for a result) and read the
state this thread keeps (``replicas``, ``nodes``), so a slow or unreachable cluster never stalls the control
plane's event loop. Each cycle the thread runs the queued jobs, then watches: Ray's node table every
``NODES_EVERY_S`` (a replica on a node Ray declared dead is lost), each running actor's status every
``STATUS_EVERY_S`` (its process alive, its exit status), and the actors of replicas the fleet forgot,
killed ``RELEASE_AFTER_S`` later unless spawned again. A cluster that stops answering is retried every
cycle and logged sparingly.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from controlplane.errors import Unavailable
from controlplane.fleet.backends.base import NodeState, ReplicaLocation, ReplicaSpec
from controlplane.fleet.backends.ray_actor import ReplicaActor, _pid_space, stop_this_node

logger = logging.getLogger(__name__)

ZONE_LABEL = "ray.io/availability-zone"
ACTOR_PREFIX = "replica-"
CYCLE_S = 0.2  # the Ray thread's wait for replies per cycle
STATUS_EVERY_S = 0.5  # each running replica's status is asked this often
NODES_EVERY_S = 1.0  # Ray's node table is read this often
NAME_RETRY_S = 0.5  # a name still held by a dead actor is tried again after this long
# A forgotten replica's actor is killed this long after: the fleet forgets a crashed replica and spawns it
# again in one breath, and the actor then starts the new process itself (same node, same port).
RELEASE_AFTER_S = 1.0
CALL_TIMEOUT_S = 30.0  # adoption, sweep, node stop and close wait this long for the Ray thread
FAILURE_LOG_EVERY_S = 30.0  # a cluster that stays unreachable is logged this often, not every cycle
NODE_STOP_WAIT_S = 30.0  # the stop task is scheduled on its node and kills it within this long

T = TypeVar("T")


class RayUnavailable(Unavailable):
    """Ray is not installed, the cluster cannot be reached, or it did not answer in time."""


@dataclass
class RayReplica:
    """What the backend knows of one replica; changed under the Ray thread's lock."""

    spec: ReplicaSpec
    order: dict[str, Any]
    phase: str = "starting"  # starting | running | exited | lost
    wanted: int = 0  # spawns asked for; a start job of an older spawn is dropped
    released_at: float | None = None  # when the fleet forgot it: its actor is killed unless a spawn comes
    actor: Any = None
    starts: int | None = None  # the actor's count of starts the current process belongs to
    start_ref: Any = None
    status_ref: Any = None
    status_at: float = 0.0
    location: ReplicaLocation | None = None
    exit_code: int | None = None
    reason: str = ""


@dataclass
class RayPlacement:
    """How replicas are placed and what each one asks of its node."""

    namespace: str
    zoned: bool = True  # place by zone label (False on a single-node Ray: it has one zone at most)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    num_npus: float = 0.0
    log_dir: str = ""
    state_dir: str = ""

    def actor_options(self, spec: ReplicaSpec) -> dict[str, Any]:
        options: dict[str, Any] = {"name": ACTOR_PREFIX + spec.replica_id, "namespace": self.namespace,
                                   "lifetime": "detached", "max_restarts": 0, "num_cpus": self.num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.num_npus:
            options["resources"] = {"NPU": self.num_npus}
        if self.zoned:
            options["label_selector"] = {ZONE_LABEL: spec.zone}
        return options


@dataclass
class _Jobs:
    """Work for the Ray thread, in order; ``wake`` cuts its wait short."""

    queue: collections.deque[Callable[[], None]] = field(default_factory=collections.deque)
    wake: threading.Event = field(default_factory=threading.Event)


class RayThread:
    """The Ray thread and the state it keeps: ``replicas`` (changed under ``lock``) and ``nodes``."""

    def __init__(self, ray: Any, placement: RayPlacement, *, clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self.ray = ray
        self.placement = placement
        self.clock = clock
        self._remote_actor = ray.remote(ReplicaActor)
        self._remote_stop = ray.remote(num_cpus=0, max_retries=0)(stop_this_node)
        self.lock = threading.Lock()
        self.replicas: dict[str, RayReplica] = {}
        self.nodes: tuple[NodeState, ...] = ()
        self._nodes_at = float("-inf")
        self._jobs = _Jobs()
        self._closing = False
        self._failing_since: float | None = None  # when the cluster stopped answering the watch
        self._failure_logged = 0.0
        self._pid_space = _pid_space()
        self._thread = threading.Thread(target=self._run, name="ray-backend", daemon=True)
        self._thread.start()

    # ---- from other threads: queue work, wait for it, stop ---------------------------------------
    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.queue.append(job)
        self._jobs.wake.set()

    def call(self, job: Callable[[], T], *, timeout_s: float = CALL_TIMEOUT_S) -> T:
        """Run ``job`` on the Ray thread and wait for its result."""
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(job())
            except BaseException as exc:
                future.set_exception(exc)

        self.submit(run)
        try:
            return future.result(timeout_s)
        except TimeoutError as exc:
            raise RayUnavailable(f"unavailable: the Ray cluster did not answer within {timeout_s:g}s") \
                from exc

    def close(self) -> None:
        """Kill the actors of forgotten replicas and finish the queued work, then leave the cluster."""
        with contextlib.suppress(RayUnavailable):
            self.call(lambda: self.release(older_than_s=0.0))
        self._closing = True
        self._jobs.wake.set()
        self._thread.join(CALL_TIMEOUT_S)
        with contextlib.suppress(Exception):  # leaving a cluster that is gone already
            self.ray.shutdown()

    # ---- the thread: run the jobs, watch the cluster ------------------------------------------------
    def _run(self) -> None:
        while not (self._closing and not self._jobs.queue):
            while self._jobs.queue:
                job = self._jobs.queue.popleft()
                try:
                    job()
                except Exception:  # one failed job (a kill of a gone actor) must not stop the thread
                    logger.exception("Ray backend job failed")
            try:
                self._watch()
                self._failing_since = None
            except Exception:  # the cluster may be unreachable for a while: keep trying, say so sparingly
                now = self.clock()
                if self._failing_since is None:
                    logger.exception("watching the Ray cluster failed; trying again every %gs", CYCLE_S)
                    self._failing_since = self._failure_logged = now
                elif now - self._failure_logged >= FAILURE_LOG_EVERY_S:
                    logger.error("the Ray cluster has not answered for %.0fs", now - self._failing_since)
                    self._failure_logged = now
                time.sleep(CYCLE_S)

    def _watch(self) -> None:
        now = self.clock()
        if now - self._nodes_at >= NODES_EVERY_S:
            self._nodes_at = now
            self.read_nodes()
        self.release(older_than_s=RELEASE_AFTER_S)
        with self.lock:
            due = [r for r in self.replicas.values() if r.phase == "running" and r.actor is not None
                   and r.status_ref is None and now - r.status_at >= STATUS_EVERY_S]
        for replica in due:
            replica.status_at = now
            replica.status_ref = replica.actor.status.remote()
        with self.lock:
            refs = [ref for r in self.replicas.values() for ref in (r.start_ref, r.status_ref)
                    if ref is not None]
        if not refs:
            self._jobs.wake.wait(CYCLE_S)
            self._jobs.wake.clear()
            return
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=CYCLE_S)
        for ref in ready:
            self._answered(ref)

    def _answered(self, ref: Any) -> None:
        with self.lock:
            owner = next(((r, kind) for r in self.replicas.values()
                          for kind, held in (("start", r.start_ref), ("status", r.status_ref))
                          if held is not None and held == ref), None)
        if owner is None:
            return
        replica, kind = owner
        try:
            result = self.ray.get(ref)
        except self.ray.exceptions.ActorUnavailableError:  # unreachable for now: ask again next time
            with self.lock:
                if replica.status_ref is not None and replica.status_ref == ref:
                    replica.status_ref = None
                elif replica.start_ref is not None and replica.start_ref == ref:
                    replica.start_ref = replica.actor.start.remote(replica.order) if replica.actor else None
            return
        except self.ray.exceptions.RayActorError as exc:
            self._lost(replica, f"its actor died: {str(exc).splitlines()[0]}")
            return
        except self.ray.exceptions.RayError as exc:  # start() itself failed on the node
            with self.lock:
                replica.start_ref = replica.status_ref = None
                replica.phase, replica.exit_code, replica.reason = "exited", None, str(exc).splitlines()[0]
            logger.error("[%s] %s failed: %s", replica.spec.replica_id, kind, replica.reason)
            return
        with self.lock:
            if kind == "start":
                replica.start_ref = None
                if replica.phase != "starting":
                    return  # drained or killed while it started: its actor is being killed
                replica.starts, replica.phase = result["starts"], "running"
                replica.location = self._location_of(result)
                logger.info("[%s] started on %s:%s (node %s)", replica.spec.replica_id, result["host"],
                            result["port"], result["node_id"][:12])
            else:
                replica.status_ref = None
                if replica.phase == "running" and result["starts"] == replica.starts \
                        and result["returncode"] is not None:
                    replica.phase, replica.exit_code = "exited", result["returncode"]

    def _location_of(self, status: dict[str, Any]) -> ReplicaLocation:
        same_machine = status["pid_space"] == self._pid_space  # the lab: namespaces share one pid space
        return ReplicaLocation(status["host"], int(status["port"]), node=status["host"],
                               node_id=status["node_id"], pid=status["pid"] if same_machine else None)

    def _lost(self, replica: RayReplica, reason: str) -> None:
        with self.lock:
            if replica.phase in ("exited", "lost"):
                return
            replica.phase, replica.actor, replica.reason = "lost", None, reason
            replica.start_ref = replica.status_ref = None
        logger.warning("[%s] lost: %s", replica.spec.replica_id, reason)

    # ---- jobs: each runs on the thread -------------------------------------------------------------
    def read_nodes(self) -> None:
        nodes = tuple(NodeState(n["NodeID"], n["NodeManagerAddress"], (n.get("Labels") or {}).get(ZONE_LABEL),
                                bool(n["Alive"])) for n in self.ray.nodes())
        self.nodes = nodes
        dead = {n.node_id for n in nodes if not n.alive}
        with self.lock:
            on_dead = [r for r in self.replicas.values() if r.location is not None
                       and r.location.node_id in dead and r.phase == "running"]
        for replica in on_dead:
            self._lost(replica, f"its node {replica.location.node if replica.location else '?'} was lost")

    def start_replica(self, replica_id: str, wanted: int) -> None:
        with self.lock:
            replica = self.replicas.get(replica_id)
            if replica is None or replica.wanted != wanted or replica.released_at is not None:
                return  # superseded by a later spawn, or forgotten
            actor = replica.actor
        try:
            if actor is None:
                actor = self._remote_actor.options(**self.placement.actor_options(replica.spec)).remote(
                    replica_id)
            ref = actor.start.remote(replica.order)  # through Ray Client, a taken name shows here
        except self.ray.exceptions.ActorAlreadyExistsError:
            actor = self._named(replica_id)  # a live actor we lost track of; None: a dead one holds the name
            if actor is None:
                again = [lambda: self.start_replica(replica_id, wanted)]
                retry = threading.Timer(NAME_RETRY_S, self.submit, again)
                retry.start()
                return
            ref = actor.start.remote(replica.order)
        with self.lock:
            replica.actor, replica.start_ref, replica.status_ref = actor, ref, None

    def release(self, *, older_than_s: float) -> None:
        """Kill the actors of replicas the fleet forgot at least ``older_than_s`` ago and not spawned
        again since, and forget them here too."""
        now = self.clock()
        with self.lock:
            gone = [r for r in self.replicas.values()
                    if r.released_at is not None and now - r.released_at >= older_than_s]
            for replica in gone:
                del self.replicas[replica.spec.replica_id]
        for replica in gone:
            actor = replica.actor or self._named(replica.spec.replica_id)
            if actor is not None:
                with contextlib.suppress(Exception):
                    self.ray.kill(actor, no_restart=True)

    def kill_actor(self, replica_id: str) -> None:
        with self.lock:
            replica = self.replicas.get(replica_id)
            actor = replica.actor if replica is not None else None
        if actor is None:
            actor = self._named(replica_id)
        if actor is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)

    def _named(self, replica_id: str) -> Any:
        try:
            return self.ray.get_actor(ACTOR_PREFIX + replica_id, namespace=self.placement.namespace)
        except ValueError:
            return None

    def adopt(self, spec: ReplicaSpec) -> bool:
        """Take over the replica's actor, found by name; False when there is none or its process has
        exited (that actor is killed)."""
        actor = self._named(spec.replica_id)
        if actor is None:
            return False
        try:
            status = self.ray.get(actor.status.remote(), timeout=CALL_TIMEOUT_S)
        except self.ray.exceptions.RayError:
            return False
        if status["pid"] is None or status["returncode"] is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
            return False
        replica = RayReplica(spec, {}, phase="running", actor=actor, starts=status["starts"],
                             location=self._location_of(status))
        with self.lock:
            self.replicas[spec.replica_id] = replica
        return True

    def sweep(self, keep: set[str]) -> list[str]:
        """Kill every replica actor of the namespace not in ``keep``; the ids of those unknown here."""
        unknown = []
        for name in self.ray.util.list_named_actors():
            replica_id = name.removeprefix(ACTOR_PREFIX)
            if not name.startswith(ACTOR_PREFIX) or replica_id in keep:
                continue
            with self.lock:
                known = self.replicas.pop(replica_id, None) is not None
            if not known:
                unknown.append(replica_id)
            self.kill_actor(replica_id)
        return unknown

    def stop_node(self, node_id: str) -> None:
        """The stop task, pinned to the node; it never answers: its worker dies with the raylet, and that
        error (within a second, long before Ray's head declares the node dead) says the node is down."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        on_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
        ref = self._remote_stop.options(scheduling_strategy=on_node).remote()
        try:
            self.ray.get(ref, timeout=NODE_STOP_WAIT_S)
        except self.ray.exceptions.GetTimeoutError as exc:
            raise RayUnavailable(f"unavailable: node {node_id} not stopped within {NODE_STOP_WAIT_S:g}s") \
                from exc
        except self.ray.exceptions.RayError:
            pass  # the worker died with its node: stopped
