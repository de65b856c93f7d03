"""The replica registry: what the fleet keeps of each replica, in memory and in the store, so that a
control plane restarted after ``kill -9`` can adopt (or stop) every replica the previous one left and take
back what the operator asked for.

Where it sits: :class:`~controlplane.fleet.reconcile.Fleet` holds a :class:`ManagedReplica` per replica,
writes it as a row (:func:`replica_row`) at every transition and the desired state under ``DESIRED_KEY``
whenever it changes, and reads both back when it starts (``Fleet.adopt_or_clean``). Each replica's admin
token derives from the control plane's secret (:func:`replica_admin_token`), so an adopted replica is
reachable too.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from controlplane.fleet.backends.base import ReplicaHandle, ReplicaLocation, ReplicaSpec
from controlplane.fleet.plan import Desired
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.store.database import ReplicaRow
from controlplane.store.files import create_private, restrict

UNPLACED = "unplaced"  # the stored host of a replica a cluster has not placed yet (its spec's host is "")
DESIRED_KEY = "fleet.desired"  # what the operator asked for survives a crash of the control plane


class FleetStore(Protocol):
    """The part of the store the fleet writes (see controlplane.store.database)."""

    def add_event(self, kind: str, subject: str, detail: dict[str, Any]) -> Any: ...

    def upsert_replica(self, row: Any) -> None: ...

    def replicas(self) -> list[Any]: ...

    def delete_replica(self, replica_id: str) -> object: ...

    def kv_put(self, key: str, value: Any) -> None: ...

    def kv_get(self, key: str, default: Any = None) -> Any: ...


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
    location: ReplicaLocation | None = None  # where a backend that places replicas put it (None: not yet)

    @property
    def endpoint(self) -> ReplicaEndpoint:
        pid = self.handle.pid if self.handle else None
        labels: tuple[tuple[str, str], ...] = ()
        if self.location is not None:
            pid = self.location.pid
            labels = tuple((k, v) for k, v in (("node", self.location.node),
                                                ("node_id", self.location.node_id)) if v)
        if self.spec.version:  # the gateways send a canary's share to the replicas of its version
            labels = (*labels, ("version", self.spec.version))
        return ReplicaEndpoint(self.spec.replica_id, self.spec.zone, self.spec.host, self.spec.port,
                               self.state, self.spec.model, pid, self.spec.generation, labels)


def replica_row(replica: ManagedReplica) -> ReplicaRow:
    """The replica as its row in the store (an unplaced one's host is ``UNPLACED``)."""
    s = replica.spec
    return ReplicaRow(
        replica_id=s.replica_id, zone=s.zone, host=s.host or UNPLACED, port=s.port,
        pid=replica.endpoint.pid, state=replica.state, model=s.model,
        generation=s.generation, started_at=time.time(), restarts=replica.restarts, version=s.version)


def desired_record(desired: Desired) -> dict[str, Any]:
    """The desired state as it is saved under ``DESIRED_KEY`` (a rollout by its target only)."""
    ro, canary = desired.rollout, desired.canary
    return {"replicas": desired.replicas, "model": desired.model, "generation": desired.generation,
            "rollout": None if ro is None else {"model": ro.model, "generation": ro.generation},
            "canary": None if canary is None else {"version": canary.version, "model": canary.model,
                                                   "replicas": canary.replicas}}


def persisted(desired: Desired) -> tuple[object, ...]:
    """The part of the desired state that is saved (a rollout's surge bookkeeping is not)."""
    ro = desired.rollout
    return desired.replicas, desired.model, desired.generation, ro and (ro.model, ro.generation), \
        desired.canary


def replica_admin_token(secret: bytes, replica_id: str) -> str:
    """Per-replica admin token derived from the control plane's secret, so an adopted replica is reachable."""
    return hmac.new(secret, replica_id.encode(), hashlib.sha256).hexdigest()


def load_or_create_secret(path: Path) -> bytes:
    if path.exists():
        restrict(path)
        return path.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(32)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)  # left by a crash between create and rename
    create_private(tmp, secret)  # 0600 from its first byte: no window in which others may read it
    tmp.replace(path)
    return secret
