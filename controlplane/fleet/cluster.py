"""The nodes of a Ray fleet as the chaos layer's :class:`~chaos.faults.cluster.ClusterControl`.

Node stops and actor kills go through Ray (:class:`~controlplane.fleet.backends.ray.RayBackend`), so they
work on any Ray cluster. Bringing a stopped node back and cutting a node's link are the infrastructure's
business: a :class:`HostControl` does them where one is given (the lab of :mod:`controlplane.lab`);
elsewhere node-loss reverts to nothing (KubeRay or the operator replaces a lost node) and node-partition is
unavailable.
"""

from __future__ import annotations

from typing import Protocol

from chaos.faults.cluster import ClusterNode
from controlplane.fleet.backends.base import NodeState, ReplicaBackend
from controlplane.fleet.backends.ray import RayBackend


class HostControl(Protocol):
    """The machines under the nodes, by address."""

    def knows(self, address: str) -> bool: ...

    def restart(self, address: str) -> None: ...

    def set_link(self, address: str, *, up: bool) -> None: ...


class FleetCluster:
    def __init__(self, backend: RayBackend, hosts: HostControl | None = None) -> None:
        self.backend = backend
        self.hosts = hosts

    def node_of(self, replica_id: str) -> ClusterNode | None:
        node = self.backend.node_of(replica_id)
        return _node(node) if node is not None and node.alive else None

    def zone_nodes(self, zone: str) -> list[ClusterNode]:
        return [_node(n) for n in self.backend.nodes() if n.alive and n.zone == zone]

    def stop_node(self, node: ClusterNode) -> None:
        if any(n.node_id == node.node_id and n.alive for n in self.backend.nodes()):
            self.backend.stop_node(node.node_id)

    def can_restart(self, node: ClusterNode) -> bool:
        return self.hosts is not None and self.hosts.knows(node.address)

    def restart_node(self, node: ClusterNode) -> None:
        if self.hosts is None:
            raise RuntimeError(f"no host control here to start {node.address} again")
        if not any(n.address == node.address and n.alive for n in self.backend.refresh_nodes()):
            self.hosts.restart(node.address)

    def can_cut(self, node: ClusterNode) -> bool:
        return self.can_restart(node)

    def set_link(self, node: ClusterNode, *, up: bool) -> None:
        """The node's link down or up. Cut for longer than Ray's health checks allow (a few seconds in the
        lab), the node was declared dead and its raylet exits once it hears so: bringing the link up then
        starts the node again, as a host that comes back would rejoin."""
        if self.hosts is None:
            raise RuntimeError(f"no host control here to cut {node.address}'s link")
        self.hosts.set_link(node.address, up=up)
        if up and not any(n.node_id == node.node_id and n.alive for n in self.backend.refresh_nodes()):
            self.restart_node(node)

    def kill_actor(self, replica_id: str) -> None:
        self.backend.kill_actor(replica_id)


def fleet_cluster(backend: ReplicaBackend, hosts: HostControl | None = None) -> FleetCluster | None:
    """The cluster under a Ray fleet; None for local processes."""
    return FleetCluster(backend, hosts) if isinstance(backend, RayBackend) else None


def _node(node: NodeState) -> ClusterNode:
    return ClusterNode(node.node_id, node.address, node.zone)
