"""Chaos on a Ray fleet in the lab, with ``on_node_loss = "spill"``: the zone-outage drill's RTO/RPO as for
local processes, a killed actor, a zone's node lost (its replica re-placed in another zone, and back when
the node returns) and a zone's link cut (a real link down on the lab's bridge).

One lab and one control plane serve the module; each test leaves three ready replicas, one per zone.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from chaos.faults.network import PortPartition, availability
from controlplane.lab import network
from controlplane.lab.lab import Lab
from controlplane.views import FleetView
from tests.controlplane.up.conftest import poll, shutdown, start, wait_ready

from .conftest import TOKEN, RayControlPlane, cmdline, ray_config, run_streams

pytestmark = [pytest.mark.exclusive, pytest.mark.slow, pytest.mark.timeout(300)]

FINISHED = ("passed", "failed", "aborted", "error", "interrupted")


@pytest.fixture(scope="module")
def spill_cp(lab: Lab, model_state: Path) -> Iterator[RayControlPlane]:
    config = ray_config(model_state, lab, on_node_loss="spill")
    cp = RayControlPlane(start(config, model_state, TOKEN), config, model_state)
    try:
        wait_ready(cp.running, 3)
        yield cp
    finally:
        shutdown(cp.running)


def fleet(cp: RayControlPlane) -> FleetView:
    with cp.running.client() as client:
        return client.fleet()


def one_per_zone(view: FleetView) -> bool:
    return view.ready_replicas == 3 and sorted(r.zone for r in view.replicas) == ["az-a", "az-b", "az-c"]


def test_the_zone_outage_drill_reports_rto_and_rpo_for_a_ray_fleet(spill_cp: RayControlPlane) -> None:
    with spill_cp.running.client() as client:
        started = client.drill_run("zone-outage", zones=["az-a"], rate=6.0, duration_s=10.0, fault_at_s=3.0,
                                   max_tokens=32)
        report = poll(lambda: client.drill(started.id), lambda r: r.status in FINISHED, timeout=200)
        document: dict[str, Any] = dict(report.document)
    fig = document["figures"]
    print(f"\nzone-outage (kill) on Ray: status {document['status']}, RTO_service {fig['rto_service_s']} s, "
          f"RTO_capacity {fig['rto_capacity_s']} s, affected {fig['requests_affected']}, failed "
          f"{fig['requests_failed']}, tokens lost {fig['tokens_lost']}, resumed {fig['requests_resumed']}")
    assert document["status"] == "passed", document.get("error") or fig
    assert document["fault_targets"] == ["az-a-1"]
    assert fig["requests_failed"] == 0 and fig["tokens_lost"] == 0 and fig["writes_lost"] == 0
    assert fig["rto_service_s"] is not None and fig["rto_capacity_s"] is not None


def test_a_killed_actor_takes_its_process_and_the_fleet_starts_a_new_actor(spill_cp: RayControlPlane) -> None:
    wait_ready(spill_cp.running, 3)
    victim = next(r for r in fleet(spill_cp).replicas if r.zone == "az-c")
    assert victim.pid is not None
    actor_pid = psutil.Process(victim.pid).ppid()
    with spill_cp.running.client() as client:
        injected = client.chaos_inject("actor-kill", replicas=[victim.replica_id], duration_s=5.0)
        assert [(f.target, f.error) for f in injected.faults] == [(victim.replica_id, None)]
        gone = poll(lambda: not psutil.pid_exists(actor_pid) or
                    psutil.Process(actor_pid).status() == psutil.STATUS_ZOMBIE, bool, timeout=15)
        assert gone, "the actor's worker process outlived the kill"
        client.chaos_revert(injected.faults[0].id or 0)  # nothing to undo: the fleet starts a new actor
    after = poll(lambda: fleet(spill_cp), lambda v: v.ready_replicas == 3 and next(
        r for r in v.replicas if r.zone == "az-c").pid not in (None, victim.pid), timeout=120)
    again = next(r for r in after.replicas if r.zone == "az-c")
    assert again.state == "ready" and again.node == victim.node
    assert again.pid is not None and psutil.Process(again.pid).ppid() != actor_pid  # a new actor
    assert not psutil.pid_exists(victim.pid)  # the old process died with its actor


def test_spill_re_places_a_lost_zones_replica_and_moves_it_back_when_the_node_returns(
        spill_cp: RayControlPlane, lab: Lab) -> None:
    wait_ready(spill_cp.running, 3)
    with spill_cp.running.client() as client:
        assert client.chaos_faults() == []
        injected = client.chaos_inject("node-loss", replicas=["az-b-1"], params={"scope": "zone"},
                                       duration_s=25.0)
        assert [(f.target, f.error) for f in injected.faults] == [("az-b-1", None)]
        spilled = poll(lambda: client.fleet(), lambda v: v.ready_replicas == 3 and "az-b" not in
                       {r.zone for r in v.replicas}, timeout=90)
        assert spilled.zones_down == ("az-b",)
        assert sorted(r.zone for r in spilled.replicas) == ["az-a", "az-a", "az-c"]
        assert any(n.address == lab.config.host("az-b").address and not n.alive for n in spilled.nodes)
        assert run_streams(spill_cp.running.gateway, 6, 8) == [8] * 6
        client.chaos_revert(injected.faults[0].id or 0)  # the lab starts the host again
        back = poll(lambda: client.fleet(), one_per_zone, timeout=120)
    assert one_per_zone(back) and back.zones_down == ()
    for r in back.replicas:
        assert r.node == lab.config.host(r.zone).address


def test_a_zones_link_cut_is_a_real_network_event_and_the_zone_comes_back(spill_cp: RayControlPlane,
                                                                           lab: Lab) -> None:
    wait_ready(spill_cp.running, 3)
    az_c = lab.config.host("az-c")
    victim = next(r for r in fleet(spill_cp).replicas if r.zone == "az-c")
    port = int(victim.url.rsplit(":", 1)[1])
    with spill_cp.running.client() as client:
        injected = client.chaos_inject("zone-outage", selector="ALL", zones=["az-c"],
                                       params={"zone": "az-c", "mode": "link-down"}, duration_s=20.0)
        assert [(f.target, f.error) for f in injected.faults] == [(victim.replica_id, None)]
        assert not next(h for h in lab.status().hosts if h.name == "az-c").link_up
        with pytest.raises(OSError):  # nothing reaches the host: no refusal, no answer at all
            socket.create_connection((az_c.address, port), timeout=1.0)
        spilled = poll(lambda: client.fleet(), lambda v: v.ready_replicas == 3 and "az-c" not in
                       {r.zone for r in v.replicas}, timeout=90)
        assert spilled.zones_down == ("az-c",)
        for fault in injected.faults:
            client.chaos_revert(fault.id or 0)
        back = poll(lambda: client.fleet(), one_per_zone, timeout=120)
    assert one_per_zone(back)
    assert all(h.link_up for h in lab.status().hosts)
    returned = next(r for r in back.replicas if r.zone == "az-c")
    assert returned.node == az_c.address
    with socket.create_connection((az_c.address, int(returned.url.rsplit(":", 1)[1])), timeout=5.0):
        pass  # the zone's replica answers on its host again


def test_the_partition_fault_cuts_a_ray_replicas_port_on_the_labs_bridge_under_load(
        spill_cp: RayControlPlane, lab: Lab) -> None:
    ok, reason = availability()
    if not ok:
        pytest.skip(f"unavailable: {reason}")
    wait_ready(spill_cp.running, 3)
    victim = next(r for r in fleet(spill_cp).replicas if r.zone == "az-a")
    host, port = victim.url.removeprefix("http://").rsplit(":", 1)
    cut: list[Any] = []

    def partition() -> None:
        with spill_cp.running.client() as client:
            cut.append(client.chaos_inject("partition", replicas=[victim.replica_id], duration_s=30.0))
        filters = PortPartition().active(lab.config.bridge)
        assert [f["port"] for f in filters] == [int(port)]  # on the lab's bridge, not on lo
        with pytest.raises(OSError):  # the replica's port is cut off: no answer at all
            socket.create_connection((host, int(port)), timeout=1.0)

    results = run_streams(spill_cp.running.gateway, 12, 24, partition)
    assert [r for r in results if not isinstance(r, int)] == []
    assert results == [24] * 12  # streams on the cut replica stalled and resumed elsewhere
    with spill_cp.running.client() as client:
        client.chaos_revert(cut[0].faults[0].id or 0)
        assert client.chaos_faults() == []
    assert PortPartition().active(lab.config.bridge) == []
    with socket.create_connection((host, int(port)), timeout=5.0):
        pass  # reachable again
    poll(lambda: fleet(spill_cp), one_per_zone, timeout=60)


def test_with_on_restart_stop_the_next_up_stops_every_actor_it_finds_and_starts_afresh(
        spill_cp: RayControlPlane, lab: Lab) -> None:
    wait_ready(spill_cp.running, 3)
    before = {r.replica_id: r.pid for r in fleet(spill_cp).replicas}
    spill_cp.running.process.send_signal(signal.SIGKILL)
    spill_cp.running.process.wait(10)
    text = spill_cp.config.read_text()
    spill_cp.config.write_text(text.replace('on_node_loss = "spill"',
                                            'on_node_loss = "spill"\non_restart = "stop"'))
    spill_cp.restart()
    wait_ready(spill_cp.running, 3)
    after = poll(lambda: fleet(spill_cp), lambda v: v.ready_replicas == 3 and not
                 {r.pid for r in v.replicas} & set(before.values()), timeout=150)
    with spill_cp.running.client() as client:
        stopped = {e.subject for e in client.events(kind="replica.orphan_stopped", limit=100)}
    assert stopped == set(before)
    assert all(not psutil.pid_exists(pid or 0) for pid in before.values())  # the old processes are gone
    assert one_per_zone(after)
    actors = [cmdline(pid) for host in lab.config.hosts for pid in network.namespace_pids(host.namespace)
              if "ReplicaActor" in cmdline(pid)]
    assert len(actors) == 3  # the new replicas' actors only: the old ones were killed, not left behind
