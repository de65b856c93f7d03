"""Replicas as detached, named Ray actors, each running ``python -m inference serve`` on its node.

Where it sits: the fleet's :class:`~controlplane.fleet.backends.base.ReplicaBackend` for a Ray cluster (on
VMs with ``ray start``, on Kubernetes through KubeRay, or the lab of :mod:`controlplane.lab`), with the
joining of that cluster (:func:`connect`). The fleet decides; this backend places and watches:

- **Placement.** One actor per replica, named ``replica-<id>`` in the control plane's Ray namespace,
  ``lifetime="detached"`` (it outlives the control plane) and ``max_restarts=0`` (the fleet, not Ray,
  decides where a lost replica goes). It is placed by the node label ``ray.io/availability-zone`` through
  ``label_selector``: Ray's own zone label, set with ``ray start --labels`` (KubeRay sets it from the
  pod's node), so no custom resource has to be kept in step with the zones. A replica whose zone has no
  node stays pending until one joins. Accelerators are Ray resources (``num_gpus``; ``NPU`` for Ascend).
- **Address.** The actor picks a free port on its node (the fleet's port is a preference) and reports
  ``host:port``; :meth:`RayBackend.location` hands it to the fleet, which publishes it to the gateways and
  Prometheus.
- **Watching.** A single thread makes every Ray call (:mod:`controlplane.fleet.backends.ray_thread`); the
  fleet's verbs here only queue work and read what it last saw, so a slow or unreachable cluster never
  stalls the control plane's event loop. It polls each actor's status (process alive, exit status) and
  Ray's node table; a replica on a node Ray declared dead is lost.
- **Adoption.** After a ``kill -9`` of the control plane, the next one finds each replica's actor by name;
  actors of its namespace that no stored replica names are killed (:meth:`RayBackend.sweep`).
- **Stop.** Drain is SIGTERM to the process through its actor; :meth:`RayBackend.forget` kills the actor,
  and with it the process (it dies with its parent).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from controlplane.fleet.backends.base import NodeState, ReplicaHandle, ReplicaLocation, ReplicaSpec
from controlplane.fleet.backends.ray_thread import (
    CALL_TIMEOUT_S,
    NODE_STOP_WAIT_S,
    RayPlacement,
    RayReplica,
    RayThread,
    RayUnavailable,
)

logger = logging.getLogger(__name__)

CONNECT_RETRY_S = 2.0  # between attempts to join a cluster that answers but refuses


def namespace_for(state_path: Path) -> str:
    """The default Ray namespace of a control plane: one per state folder, so that two control planes on
    one cluster never adopt each other's replicas."""
    digest = hashlib.sha256(str(state_path.resolve()).encode()).hexdigest()[:10]
    return f"llmsre-{digest}"


def connect(address: str, namespace: str, *, timeout_s: float) -> Any:
    """Join the Ray cluster at ``address`` (``auto``, ``ray://host:port`` or ``local``) in ``namespace``;
    the ``ray`` module. RayUnavailable, in one line, when Ray is missing or the cluster does not answer.
    A cluster that answers but refuses is asked again until ``timeout_s`` (a head that has just started,
    or a busy one, may fail a Ray Client's first session: its client server sometimes loses the race with
    the session server it spawns, and says so only after 30 s)."""
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable("unavailable: fleet.backend = \"ray\" needs the ray package "
                             "(pip install '.[ray]')") from exc
    if address.startswith("ray://"):
        _reachable(address, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if address == "local":  # a private single-node Ray: one node, so zones are not placed
                ray.init(namespace=namespace, include_dashboard=False, log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=False)
            else:
                ray.init(address=address, namespace=namespace, log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=False)
            return ray
        except Exception as exc:  # Ray raises ConnectionError, RuntimeError or its own errors here
            with contextlib.suppress(Exception):
                ray.shutdown()
            if time.monotonic() + CONNECT_RETRY_S >= deadline:
                said = " ".join(str(exc).split()) or type(exc).__name__
                raise RayUnavailable(f"unavailable: cannot join the Ray cluster at {address}: {said}") \
                    from exc
            logger.warning("joining the Ray cluster at %s failed (%s); trying again", address,
                           " ".join(str(exc).split())[:200])
            time.sleep(CONNECT_RETRY_S)


def _reachable(address: str, timeout_s: float) -> None:
    """A TCP connect to a Ray Client address first: an unreachable cluster fails in seconds, not after
    Ray Client's own 30 s of retries."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=min(timeout_s, 5.0)):
            return
    except OSError as exc:
        raise RayUnavailable(f"unavailable: the Ray cluster at {address} does not answer: {exc}") from exc


class RayBackend:
    places_replicas = True

    def __init__(self, ray: Any, placement: RayPlacement, *, clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self.ray = ray
        self.placement = placement
        self.clock = clock
        self._thread = RayThread(ray, placement, clock=clock)

    # ---- the fleet's verbs: queue work, read what the Ray thread saw ----------------------------
    def spawn(self, spec: ReplicaSpec) -> ReplicaHandle:
        log_path = self._log_path(spec)
        order = {"port": spec.port, "log_path": log_path, "args": _serve_args(spec),
                 "env": {"LLMSRE_STATE_DIR": self.placement.state_dir, "OMP_WAIT_POLICY": "PASSIVE",
                         "INFERENCE_ADMIN_TOKEN": spec.admin_token}}
        with self._thread.lock:
            replica = self._thread.replicas.setdefault(spec.replica_id, RayReplica(spec, order))
            replica.spec, replica.order, replica.phase, replica.released_at = spec, order, "starting", None
            replica.location, replica.exit_code, replica.start_ref = None, None, None
            replica.wanted += 1
            wanted = replica.wanted
        self._thread.submit(lambda: self._thread.start_replica(spec.replica_id, wanted))
        logger.info("[%s] spawning an actor in zone %s (namespace %s)", spec.replica_id, spec.zone,
                    self.placement.namespace)
        return ReplicaHandle(spec.replica_id, None, log_path)

    def is_running(self, handle: ReplicaHandle) -> bool:
        replica = self._thread.replicas.get(handle.replica_id)
        return replica is not None and replica.phase in ("starting", "running")

    def exit_status(self, handle: ReplicaHandle) -> int | None:
        replica = self._thread.replicas.get(handle.replica_id)
        return replica.exit_code if replica is not None and replica.phase == "exited" else None

    def drain(self, handle: ReplicaHandle) -> None:
        self._stop(handle.replica_id, "SIGTERM")

    def kill(self, handle: ReplicaHandle) -> None:
        self._stop(handle.replica_id, "SIGKILL")

    def forget(self, handle: ReplicaHandle) -> None:
        with self._thread.lock:
            replica = self._thread.replicas.get(handle.replica_id)
            if replica is not None:
                replica.released_at = self.clock()

    def location(self, handle: ReplicaHandle) -> ReplicaLocation | None:
        replica = self._thread.replicas.get(handle.replica_id)
        return replica.location if replica is not None and replica.phase == "running" else None

    def nodes(self) -> Sequence[NodeState]:
        return self._thread.nodes

    def refresh_nodes(self) -> Sequence[NodeState]:
        """Ray's node table read now (``nodes()`` is at most a second old)."""
        self._thread.call(self._thread.read_nodes)
        return self._thread.nodes

    def adopt(self, spec: ReplicaSpec, pid: int | None) -> ReplicaHandle | None:
        """The replica's actor, found by name; None when there is none or its process has exited."""
        if not self._thread.call(lambda: self._thread.adopt(spec)):
            return None
        return ReplicaHandle(spec.replica_id, None, self._log_path(spec))

    def sweep(self, *, keep: set[str]) -> list[str]:
        """Kill every replica actor of this namespace that the fleet does not keep; the ids of those the
        backend knew nothing of (an actor created just before a crash, before its row was saved)."""
        return self._thread.call(lambda: self._thread.sweep(keep))

    def close(self) -> None:
        """Kill the actors of forgotten replicas and finish the queued work, then leave the cluster."""
        self._thread.close()

    # ---- chaos: node and actor events ------------------------------------------------------------
    def node_of(self, replica_id: str) -> NodeState | None:
        replica = self._thread.replicas.get(replica_id)
        node_id = replica.location.node_id if replica is not None and replica.location else None
        return next((n for n in self._thread.nodes if n.node_id == node_id), None)

    def stop_node(self, node_id: str) -> None:
        """Stop one node (its raylet and everything on it die); returns once it is down (Ray's head declares
        it dead a few seconds later, and the fleet hears of it from there)."""
        self._thread.call(lambda: self._thread.stop_node(node_id),
                          timeout_s=CALL_TIMEOUT_S + NODE_STOP_WAIT_S)

    def kill_actor(self, replica_id: str) -> None:
        """Kill the replica's actor (its process dies with it), as a crash of the actor would."""
        self._thread.call(lambda: self._thread.kill_actor(replica_id))

    # ---- mechanics -------------------------------------------------------------------------------
    def _stop(self, replica_id: str, signal_name: str) -> None:
        with self._thread.lock:
            replica = self._thread.replicas.get(replica_id)
            if replica is None or replica.phase not in ("starting", "running"):
                return
            if replica.phase == "starting":  # no process yet (maybe no node): the actor goes instead
                replica.phase, replica.exit_code, replica.wanted = "exited", None, replica.wanted + 1
                self._thread.submit(lambda: self._thread.kill_actor(replica_id))
                return
            actor = replica.actor
        if actor is not None:
            self._thread.submit(lambda: actor.signal.remote(signal_name))

    def _log_path(self, spec: ReplicaSpec) -> str:
        return str(Path(self.placement.log_dir) / f"{spec.replica_id}.log")


def _serve_args(spec: ReplicaSpec) -> list[str]:
    """``inference serve``'s arguments after host and port (the actor picks those on its node)."""
    return ["--model", spec.model, "--replica-id", spec.replica_id, "--zone", spec.zone,
            "--num-threads", str(spec.threads), "--max-num-seqs", str(spec.max_num_seqs),
            "--drain-timeout", str(spec.drain_timeout_s), *spec.engine_args(), *spec.tracing_args()]
