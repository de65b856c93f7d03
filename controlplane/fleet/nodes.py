"""The nodes the fleet's replicas run on, as the last reconcile pass saw them: which are alive, which of
the fleet's zones have no live node, and the node each replica last ran on (kept over restarts, so that a
lost node's event names the replicas it took with it).

Where it sits: :class:`~controlplane.fleet.reconcile.Fleet` hands :meth:`Nodes.observe` the backend's node
table at the start of each pass (only a backend that places replicas has nodes: local processes have none)
and :meth:`Nodes.placed` each replica's node as the backend reports it; the pure plan reads
:attr:`Nodes.zones_down`. A node lost or joined, and a zone down or back up, are events in the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from controlplane.fleet.backends.base import NodeState
from controlplane.fleet.config import FleetConfig

logger = logging.getLogger(__name__)


class Nodes:
    def __init__(self, config: FleetConfig, event: Callable[[str, str, dict[str, Any]], None]) -> None:
        self.config = config
        self._event = event
        self._nodes: dict[str, NodeState] = {}  # the backend's nodes as the last pass saw them
        self._placed_on: dict[str, str] = {}  # replica id -> the node id it last ran on (kept over restarts)
        self._zones_down: frozenset[str] = frozenset()

    def listed(self) -> list[NodeState]:
        """The live nodes, and each lost one whose address no live node has taken over, so a lost host
        shows until it is back."""
        alive = {n.address for n in self._nodes.values() if n.alive}
        return sorted((n for n in self._nodes.values() if n.alive or n.address not in alive),
                      key=lambda n: (n.zone or "", n.address, not n.alive))

    @property
    def zones_down(self) -> frozenset[str]:
        """Zones of the fleet without a live node."""
        return self._zones_down

    def placed(self, replica_id: str, node_id: str) -> None:
        self._placed_on[replica_id] = node_id

    def forget(self, replica_id: str) -> None:
        self._placed_on.pop(replica_id, None)

    def observe(self, seen_nodes: Sequence[NodeState]) -> None:
        """The backend's nodes: a node lost or joined, and a zone left without nodes or back, are events."""
        seen = {n.node_id: n for n in seen_nodes}
        if not seen:
            return  # not looked at yet: no news, and no zone counts as down
        if self._nodes:
            for node in seen.values():
                was = self._nodes.get(node.node_id)
                if node.alive and (was is None or not was.alive):
                    self._event("node.joined", node.address, {"node_id": node.node_id, "zone": node.zone})
                elif not node.alive and was is not None and was.alive:
                    self._lost(node)
        self._nodes = seen
        alive_zones = {n.zone for n in seen.values() if n.alive}
        down = frozenset(z for z in self.config.zones if z not in alive_zones)
        for zone in sorted(down - self._zones_down):
            self._event("zone.down", zone, {"policy": self.config.on_node_loss})
        for zone in sorted(self._zones_down - down):
            self._event("zone.up", zone, {})
        self._zones_down = down

    def _lost(self, node: NodeState) -> None:
        on_it = sorted(rid for rid, node_id in self._placed_on.items() if node_id == node.node_id)
        logger.warning("node %s (%s, zone %s) lost; replicas on it: %s", node.address, node.node_id,
                       node.zone, ", ".join(on_it) or "none")
        self._event("node.lost", node.address, {"node_id": node.node_id, "zone": node.zone,
                                                "replicas": on_it, "policy": self.config.on_node_loss})
