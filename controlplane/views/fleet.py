"""The fleet as the API shows it: its replicas, the nodes they run on, the gateways and a rolling update
(``/api/v1/fleet``, ``/api/v1/gateways``). Part of :mod:`controlplane.views`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class ReplicaView:
    replica_id: str
    zone: str
    url: str
    state: str  # starting | ready | draining | ejected | crashed | stopped
    model: str
    pid: int | None
    generation: int
    node: str | None = None  # the cluster node's address (Ray backend); None for local processes


@dataclass(slots=True, frozen=True)
class NodeView:
    """A node of the cluster the replicas run on; ``alive`` False: lost (shown until it is back)."""

    node_id: str
    address: str
    zone: str | None
    alive: bool


@dataclass(slots=True, frozen=True)
class GatewayView:
    """A gateway process: its state as the supervisor sees it and as it last reported it (routable and
    ejected replicas, streams in flight per replica, where its replica set came from, its report queues)."""

    name: str
    pid: int | None
    state: str  # starting | ready | crashed | stopped
    admin_port: int
    restarts: int
    routable: tuple[str, ...] = ()
    ejected: tuple[str, ...] = ()
    inflight: Mapping[str, int] = field(default_factory=dict)
    replica_set: Mapping[str, Any] = field(default_factory=dict)  # source, version, replicas
    reports: Mapping[str, Any] = field(default_factory=dict)  # buffered, dropped, delivered


@dataclass(slots=True, frozen=True)
class RolloutView:
    """A rolling update: to ``model`` as ``generation``; ``surge`` is the new replica being waited on."""

    model: str
    generation: int
    surge: str | None = None


@dataclass(slots=True, frozen=True)
class FleetView:
    desired_replicas: int
    ready_replicas: int
    model: str
    generation: int
    zones: tuple[str, ...]
    rollout: RolloutView | None
    replicas: tuple[ReplicaView, ...]
    nodes: tuple[NodeView, ...] = ()  # empty for local processes
    zones_down: tuple[str, ...] = ()  # zones without a live node
