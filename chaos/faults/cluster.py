"""Cluster faults, for replicas placed on the nodes of a cluster (Ray): a node is lost, a node's link is
cut, a replica's actor is killed.

- ``node-loss``: the target's node stops (Ray's raylet and everything on it die, replicas included), or
  with ``scope = "zone"`` every node of the target's zone. Revert starts the node again where the
  infrastructure allows it (the lab); elsewhere there is nothing to revert: the cluster's own
  provisioning (KubeRay, an instance group) replaces a lost node, and the fleet places replicas again.
- ``node-partition``: the target's node (or zone) is cut off the network: its link goes down, a real
  network event; revert brings it up. Only where the link can be cut (the lab's veths).
- ``actor-kill``: the replica's actor is killed through the cluster (its process dies with it); the fleet
  starts it again, as after ``kill``.

The cluster is reached through the small :class:`ClusterControl` protocol (the control plane's Ray
backend satisfies it). Tokens hold the nodes' ids, addresses and zones, never a secret, so a control
plane started after a crash can revert what an earlier one left. Without a cluster the kinds are listed
unavailable.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Protocol

from chaos.faults.base import (
    Fault,
    FaultError,
    FaultKindInfo,
    FaultSpec,
    ParamInfo,
    RevertFailed,
    RevertToken,
    check_params,
)
from chaos.targets import Target

SCOPES = ("node", "zone")
NO_CLUSTER = "the fleet runs local processes, not on a cluster (fleet.backend = \"ray\" has nodes)"


@dataclass(slots=True, frozen=True)
class ClusterNode:
    node_id: str
    address: str
    zone: str | None


class ClusterControl(Protocol):
    """The cluster a fleet's replicas are placed on. The node verbs block (run in a thread) and are
    idempotent: stopping a stopped node or restarting a live one does nothing."""

    def node_of(self, replica_id: str) -> ClusterNode | None:
        """The live node the replica runs on (None: not placed, or its node is gone)."""
        ...

    def zone_nodes(self, zone: str) -> list[ClusterNode]:
        """The live nodes of ``zone``."""
        ...

    def stop_node(self, node: ClusterNode) -> None: ...

    def can_restart(self, node: ClusterNode) -> bool: ...

    def restart_node(self, node: ClusterNode) -> None: ...

    def can_cut(self, node: ClusterNode) -> bool: ...

    def set_link(self, node: ClusterNode, *, up: bool) -> None: ...

    def kill_actor(self, replica_id: str) -> None: ...


_SCOPE = ParamInfo("scope", "string", "node (the target's node) or zone (every node of its zone)",
                   required=False, default="node")
_INFOS = {
    "node-loss": FaultKindInfo(
        kind="node-loss", family="node", takes_down=True, params=(_SCOPE,),
        description="stop the cluster node a replica runs on (its raylet and everything on it die); revert "
                    "starts it again where the infrastructure allows (the lab)"),
    "node-partition": FaultKindInfo(
        kind="node-partition", family="node", takes_down=True, params=(_SCOPE,),
        description="cut the network link of the node a replica runs on (a real link down); revert "
                    "restores it"),
    "actor-kill": FaultKindInfo(
        kind="actor-kill", family="node", takes_down=True,
        description="kill the replica's actor through the cluster (its process dies with it); the fleet "
                    "starts it again"),
}


class _ClusterFault(Fault):
    kind_name: str

    def __init__(self, cluster: ClusterControl | None) -> None:
        self.cluster = cluster

    def describe(self) -> FaultKindInfo:
        info = _INFOS[self.kind_name]
        if self.cluster is None:
            return FaultKindInfo(info.kind, info.family, info.description, info.params, info.takes_down,
                                 available=False, unavailable_reason=NO_CLUSTER)
        return info

    def validate(self, spec: FaultSpec) -> None:
        if spec.kind != self.kind_name:
            raise ValueError(f"kind: expected {self.kind_name!r}, got {spec.kind!r}")
        params = check_params(spec, _INFOS[self.kind_name])
        if "scope" in params and params["scope"] not in SCOPES:
            raise ValueError(f"params.scope: must be one of {', '.join(SCOPES)}, got {params['scope']!r}")

    def _control(self) -> ClusterControl:
        if self.cluster is None:
            raise FaultError(f"unavailable: {NO_CLUSTER}")
        return self.cluster

    def _nodes(self, spec: FaultSpec, target: Target) -> list[ClusterNode]:
        """The nodes the fault hits for ``target``: its own, or every live node of its zone."""
        cluster = self._control()
        if spec.params.get("scope", "node") == "zone":
            nodes = cluster.zone_nodes(target.zone)
            if not nodes:
                raise FaultError(f"{target.replica_id}: zone {target.zone} has no live node")
            return nodes
        node = cluster.node_of(target.replica_id)
        if node is None:
            raise FaultError(f"{target.replica_id}: not running on a live cluster node")
        return [node]


def _nodes_json(nodes: list[ClusterNode]) -> str:
    return json.dumps([[n.node_id, n.address, n.zone] for n in nodes])


def _nodes_of(token: RevertToken) -> list[ClusterNode]:
    try:
        return [ClusterNode(str(i), str(a), None if z is None else str(z))
                for i, a, z in json.loads(str(token.data["nodes"]))]
    except (KeyError, ValueError, TypeError) as exc:
        raise RevertFailed(f"{token.target}: malformed revert token {token.to_json()!r}",
                           retryable=False) from exc


class NodeLossFault(_ClusterFault):
    kind_name = "node-loss"

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        nodes = self._nodes(spec, target)
        restart = all(self._control().can_restart(n) for n in nodes)
        return RevertToken(self.kind_name, target.replica_id, "restart_nodes" if restart else "none",
                           {"nodes": _nodes_json(nodes)})

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        self.validate(spec)
        token = self.prepare(spec, target)
        for node in _nodes_of(token):
            try:
                await asyncio.to_thread(self._control().stop_node, node)
            except Exception as exc:  # the cluster's own error, from its thread
                raise FaultError(f"{target.replica_id}: node {node.address} not stopped: {exc}") from exc
        return token

    async def revert(self, token: RevertToken) -> None:
        if token.action == "none":
            return
        if self.cluster is None:
            raise RevertFailed(f"{token.target}: no cluster in this process to restart nodes on",
                               retryable=True)
        for node in _nodes_of(token):
            try:
                await asyncio.to_thread(self.cluster.restart_node, node)
            except Exception as exc:
                raise RevertFailed(f"{token.target}: node {node.address} not restarted: {exc}",
                                   retryable=True) from exc


class NodePartitionFault(_ClusterFault):
    kind_name = "node-partition"

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        nodes = self._nodes(spec, target)
        uncut = [n.address for n in nodes if not self._control().can_cut(n)]
        if uncut:
            raise FaultError(f"unavailable: the links of {', '.join(uncut)} cannot be cut from here "
                             "(only the lab's can)")
        return RevertToken(self.kind_name, target.replica_id, "link_up", {"nodes": _nodes_json(nodes)})

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        self.validate(spec)
        token = self.prepare(spec, target)
        for node in _nodes_of(token):
            try:
                await asyncio.to_thread(self._control().set_link, node, up=False)
            except Exception as exc:
                raise FaultError(f"{target.replica_id}: link of {node.address} not cut: {exc}") from exc
        return token

    async def revert(self, token: RevertToken) -> None:
        if self.cluster is None:
            raise RevertFailed(f"{token.target}: no cluster in this process to restore links on",
                               retryable=True)
        for node in _nodes_of(token):
            try:
                await asyncio.to_thread(self.cluster.set_link, node, up=True)
            except Exception as exc:
                raise RevertFailed(f"{token.target}: link of {node.address} not restored: {exc}",
                                   retryable=True) from exc


class ActorKillFault(_ClusterFault):
    kind_name = "actor-kill"

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        self._control()
        return RevertToken(self.kind_name, target.replica_id, "none", {})

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        self.validate(spec)
        try:
            await asyncio.to_thread(self._control().kill_actor, target.replica_id)
        except Exception as exc:
            raise FaultError(f"{target.replica_id}: actor not killed: {exc}") from exc
        return self.prepare(spec, target)

    async def revert(self, token: RevertToken) -> None:
        return None  # the fleet starts the replica again


def cluster_faults(cluster: ClusterControl | None) -> list[Fault]:
    return [NodeLossFault(cluster), NodePartitionFault(cluster), ActorKillFault(cluster)]
