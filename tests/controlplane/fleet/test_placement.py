"""The fleet over a backend that places replicas itself (as Ray does): addresses published when known,
node losses reported, and the zone's replicas re-placed by policy. A simulated cluster and clock; the real
Ray backend runs in ``tests/controlplane/ray/``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from controlplane.fleet.backends.base import NodeState, ReplicaHandle, ReplicaLocation, ReplicaSpec
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.reconcile import Fleet
from controlplane.replicas import ReplicaEndpoint
from controlplane.store.database import Store


@dataclass
class SimCluster:
    """One node per zone; a spawned replica waits until ``place()`` puts it on its zone's live node."""

    places_replicas = True
    nodes_by_zone: dict[str, NodeState] = field(default_factory=lambda: {
        z: NodeState(f"{z}-node-1", f"10.9.0.{i + 3}", z, True)
        for i, z in enumerate(("az-a", "az-b", "az-c"))})
    lost: list[NodeState] = field(default_factory=list)
    pending: dict[str, ReplicaSpec] = field(default_factory=dict)
    placed: dict[str, ReplicaLocation] = field(default_factory=dict)
    exited: set[str] = field(default_factory=set)
    next_pid: int = 500

    def spawn(self, spec: ReplicaSpec) -> ReplicaHandle:
        self.placed.pop(spec.replica_id, None)
        self.exited.discard(spec.replica_id)
        self.pending[spec.replica_id] = spec
        return ReplicaHandle(spec.replica_id, None)

    def place(self) -> None:
        for rid, spec in list(self.pending.items()):
            node = self.nodes_by_zone.get(spec.zone)
            if node is not None and node.alive:
                self.next_pid += 1
                self.placed[rid] = ReplicaLocation(node.address, 9000 + self.next_pid, node.address,
                                                   node.node_id, self.next_pid)
                del self.pending[rid]

    def lose(self, zone: str) -> None:
        node = self.nodes_by_zone[zone]
        self.lost.append(NodeState(node.node_id, node.address, zone, False))
        del self.nodes_by_zone[zone]
        for rid, where in list(self.placed.items()):
            if where.node_id == node.node_id:
                self.exited.add(rid)

    def rejoin(self, zone: str) -> None:
        old = next(n for n in self.lost if n.zone == zone)
        self.nodes_by_zone[zone] = NodeState(f"{zone}-node-2", old.address, zone, True)

    def is_running(self, handle: ReplicaHandle) -> bool:
        rid = handle.replica_id
        return (rid in self.pending or rid in self.placed) and rid not in self.exited

    def exit_status(self, handle: ReplicaHandle) -> int | None:
        return None

    def drain(self, handle: ReplicaHandle) -> None:
        self.pending.pop(handle.replica_id, None)
        self.exited.add(handle.replica_id)

    def kill(self, handle: ReplicaHandle) -> None:
        self.drain(handle)

    def adopt(self, spec: ReplicaSpec, pid: int | None) -> ReplicaHandle | None:
        return None

    def forget(self, handle: ReplicaHandle) -> None:
        self.placed.pop(handle.replica_id, None)

    def location(self, handle: ReplicaHandle) -> ReplicaLocation | None:
        return None if handle.replica_id in self.exited else self.placed.get(handle.replica_id)

    def nodes(self) -> list[NodeState]:
        return [*self.nodes_by_zone.values(), *self.lost]


@dataclass
class Harness:
    fleet: Fleet
    cluster: SimCluster
    store: Store
    probed: list[str] = field(default_factory=list)
    now: float = 1000.0

    def tick(self, seconds: float = 0.5) -> None:
        self.now += seconds
        self.cluster.place()
        asyncio.run(self.fleet.reconcile())

    def events(self, prefix: str) -> list[tuple[str, str]]:
        return [(e.kind, e.subject) for e in self.store.events(kind_prefix=prefix, limit=5000)]


def make(tmp_path: Path, **overrides: object) -> Harness:
    config = FleetConfig(**{"replicas": 3, "base_port": 18101, "restart_backoff_s": 0.5, **overrides})  # type: ignore[arg-type]
    store, cluster = Store(tmp_path / "cp.db"), SimCluster()
    harness: Harness

    async def probe(endpoint: ReplicaEndpoint) -> bool:
        harness.probed.append(f"{endpoint.replica_id}@{endpoint.host}")
        return True

    fleet = Fleet(config, cluster, store, secret=b"s" * 32, clock=lambda: harness.now,  # type: ignore[arg-type]
                  ready_probe=probe)
    harness = Harness(fleet, cluster, store)
    return harness


def test_a_placed_replica_is_published_at_the_node_and_port_the_backend_reports(tmp_path: Path) -> None:
    h = make(tmp_path)
    h.cluster.nodes_by_zone["az-c"] = NodeState("az-c-node-1", "10.9.0.5", "az-c", False)  # not placeable
    h.tick()  # spawns; placed before the next pass
    h.tick()
    by_id = {e.replica_id: e for e in h.fleet.endpoints()}
    assert by_id["az-a-1"].host == "10.9.0.3" and by_id["az-a-1"].port == h.cluster.placed["az-a-1"].port
    assert dict(by_id["az-a-1"].labels)["node"] == "10.9.0.3"
    assert by_id["az-a-1"].pid == h.cluster.placed["az-a-1"].pid
    assert by_id["az-c-1"].state.value == "starting" and by_id["az-c-1"].host == ""  # no address yet
    assert not any(p.startswith("az-c-1") for p in h.probed)  # never probed before it is placed
    rows = {r.replica_id: r for r in h.store.replicas()}
    assert rows["az-a-1"].host == "10.9.0.3" and rows["az-c-1"].host == "unplaced"
    assert ("replica.placed", "az-a-1") in h.events("replica.placed")


def test_a_lost_node_is_an_event_and_its_zone_waits_for_a_node_by_default(tmp_path: Path) -> None:
    h = make(tmp_path)
    for _ in range(3):
        h.tick()
    assert h.fleet.num_ready() == 3
    h.cluster.lose("az-b")
    h.tick()
    [lost] = h.store.events(kind_prefix="node.lost")
    assert lost.subject == "10.9.0.4" and lost.detail["replicas"] == ["az-b-1"]
    assert h.events("zone.down") == [("zone.down", "az-b")]
    assert h.fleet.zones_down == {"az-b"}
    assert [(n.address, n.alive) for n in h.fleet.nodes() if n.zone == "az-b"] == [("10.9.0.4", False)]
    for _ in range(4):
        h.tick()
    states = {e.replica_id: (e.zone, e.state.value) for e in h.fleet.endpoints()}
    assert states == {"az-a-1": ("az-a", "ready"), "az-b-1": ("az-b", "starting"),
                      "az-c-1": ("az-c", "ready")}

    h.cluster.rejoin("az-b")
    for _ in range(3):
        h.tick()
    assert h.fleet.num_ready() == 3 and h.fleet.zones_down == frozenset()
    assert ("node.joined", "10.9.0.4") in h.events("node.joined")
    assert h.events("zone.up") == [("zone.up", "az-b")]
    assert all(n.alive for n in h.fleet.nodes())  # the lost node's address is live again: no banner


def test_spill_places_a_lost_zones_replica_elsewhere_and_moves_it_back(tmp_path: Path) -> None:
    h = make(tmp_path, on_node_loss="spill")
    for _ in range(3):
        h.tick()
    h.cluster.lose("az-b")
    for _ in range(4):
        h.tick()
    zones = sorted(e.zone for e in h.fleet.endpoints())
    assert zones == ["az-a", "az-a", "az-c"] and h.fleet.num_ready() == 3

    h.cluster.rejoin("az-b")
    for _ in range(6):
        h.tick()
    assert sorted(e.zone for e in h.fleet.endpoints() if e.state.value == "ready") == ["az-a", "az-b", "az-c"]
