"""The fleet on a real Ray cluster spread over real hosts (network namespaces), through a real
``controlplane up``: placement by zone, a killed replica process, scaling with drains, the loss of a node
under load as a drill, and a ``kill -9`` of the control plane with adoption of every actor.

One lab and one control plane serve the whole module (the tests run in this order and each leaves the
fleet at three ready replicas, one per zone); the lab is torn down by its fixture even when a test fails.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from controlplane.lab import network
from controlplane.lab.lab import Lab
from controlplane.views import FleetView
from tests.controlplane.up.conftest import gateway_pids, poll, wait_ready

from .conftest import RayControlPlane, cmdline, is_ray_process, root_listeners, run_streams

pytestmark = [pytest.mark.exclusive, pytest.mark.slow, pytest.mark.timeout(300)]

NUM_STREAMS = 30
MAX_TOKENS = 32
FINISHED = ("passed", "failed", "aborted", "error", "interrupted")


def fleet(cp: RayControlPlane) -> FleetView:
    with cp.running.client() as client:
        return client.fleet()


def by_zone(view: FleetView) -> dict[str, list[Any]]:
    zones: dict[str, list[Any]] = {}
    for r in view.replicas:
        zones.setdefault(r.zone, []).append(r)
    return zones


def assert_one_ready_replica_per_zone_host(view: FleetView, lab: Lab) -> None:
    assert view.ready_replicas == 3, view
    for zone, replicas in by_zone(view).items():
        (replica,) = replicas
        host = lab.config.host(zone)
        assert replica.state == "ready"
        assert replica.node == host.address, f"{replica.replica_id} runs on {replica.node}, not {zone}'s host"
        assert replica.url.startswith(f"http://{host.address}:")


def test_three_replicas_are_placed_one_per_zone_host_and_serve_through_the_gateway(
        ray_cp: RayControlPlane, lab: Lab) -> None:
    view = fleet(ray_cp)
    assert_one_ready_replica_per_zone_host(view, lab)
    assert sorted(by_zone(view)) == ["az-a", "az-b", "az-c"]
    assert {n.address for n in view.nodes if n.alive} >= {h.address for h in lab.config.hosts if h.zone}

    env = {**os.environ, "CONTROLPLANE_URL": ray_cp.running.api, "CONTROLPLANE_TOKEN": ray_cp.running.token}
    status = subprocess.run([sys.executable, "-m", "controlplane", "status"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "NODE" in status.stdout and "ZONE" in status.stdout
    for zone in ("az-a", "az-b", "az-c"):
        line = next(x for x in status.stdout.splitlines() if x.startswith(f"{zone}-1 "))
        assert zone in line and lab.config.host(zone).address in line and "ready" in line

    results = run_streams(ray_cp.running.gateway, 6, 8)
    assert results == [8] * 6

    # Nothing Ray started listens in the root namespace, so nothing of it is on the external interface.
    ours = {ray_cp.running.process.pid, *gateway_pids(ray_cp.running.state_dir)}
    for address, pid in root_listeners():
        host = address.rsplit(":", 1)[0].strip("[]")
        if pid is None:
            continue
        assert not is_ray_process(pid), f"a Ray process (pid {pid}) listens on {address}"
        if host not in ("*", "0.0.0.0", "::") and ipaddress.ip_address(host.split("%")[0]).is_loopback:
            continue
        assert pid not in ours, f"a process of the control plane listens on {address}"


def test_kill_9_of_a_replica_process_under_30_streams_fails_none_and_its_actor_restarts_it(
        ray_cp: RayControlPlane) -> None:
    wait_ready(ray_cp.running, 3)
    victim = next(r for r in fleet(ray_cp).replicas if r.zone == "az-c")
    assert victim.pid is not None  # the lab's hosts share this machine's pid space
    actor_pid = psutil.Process(victim.pid).ppid()  # the replica is a child of its actor's worker
    killed_at: list[float] = []

    def kill() -> None:
        os.kill(victim.pid or 0, signal.SIGKILL)
        killed_at.append(time.time())

    results = run_streams(ray_cp.running.gateway, NUM_STREAMS, MAX_TOKENS, kill)
    failures = [r for r in results if not isinstance(r, int)]
    assert failures == [], failures[:3]
    assert results == [MAX_TOKENS] * NUM_STREAMS  # every stream complete (resumed on the others)

    after = poll(lambda: fleet(ray_cp), lambda v: v.ready_replicas == 3 and next(
        r for r in v.replicas if r.replica_id == victim.replica_id).pid != victim.pid, timeout=90)
    again = next(r for r in after.replicas if r.replica_id == victim.replica_id)
    assert again.state == "ready" and again.pid is not None and again.pid != victim.pid
    assert again.node == victim.node and again.url == victim.url  # same node, same port
    assert psutil.Process(again.pid).ppid() == actor_pid  # the same actor started the new process
    with ray_cp.running.client() as client:
        crashed = [e for e in client.events(kind="replica.crashed", limit=1000)
                   if e.subject == victim.replica_id and e.ts >= killed_at[0]]
    assert crashed and crashed[0].detail["exit_status"] == -signal.SIGKILL


def test_scale_to_5_then_to_2_drains_before_removal_and_loses_no_stream(ray_cp: RayControlPlane,
                                                                        lab: Lab) -> None:
    wait_ready(ray_cp.running, 3)
    with ray_cp.running.client() as client:
        client.scale(5)
    wide = poll(lambda: fleet(ray_cp), lambda v: v.ready_replicas == 5, timeout=150)
    assert wide.ready_replicas == 5
    for r in wide.replicas:  # each new replica in its zone's host too
        assert r.node == lab.config.host(r.zone).address
    scaled_at: list[float] = []

    def scale_down() -> None:
        with ray_cp.running.client() as client:
            client.scale(2)
        scaled_at.append(time.time())

    results = run_streams(ray_cp.running.gateway, NUM_STREAMS, MAX_TOKENS, scale_down)
    failures = [r for r in results if not isinstance(r, int)]
    assert failures == [], failures[:3]
    assert results == [MAX_TOKENS] * NUM_STREAMS

    narrow = poll(lambda: fleet(ray_cp), lambda v: len(v.replicas) == 2 and v.ready_replicas == 2, timeout=90)
    assert len(narrow.replicas) == 2
    with ray_cp.running.client() as client:
        events = [e for e in client.events(kind="replica.", limit=2000) if e.ts >= scaled_at[0] - 1]
    removed = {r.replica_id for r in wide.replicas} - {r.replica_id for r in narrow.replicas}
    assert len(removed) == 3
    for rid in removed:
        kinds = [e.kind for e in events if e.subject == rid]
        assert "replica.draining" in kinds and "replica.stopped" in kinds, (rid, kinds)
        assert kinds.index("replica.draining") < kinds.index("replica.stopped")

    with ray_cp.running.client() as client:
        client.scale(3)
    assert_one_ready_replica_per_zone_host(
        poll(lambda: fleet(ray_cp), lambda v: v.ready_replicas == 3 and len(v.replicas) == 3, timeout=150),
        lab)


def test_loss_of_the_az_b_node_under_load_fails_no_stream_and_the_replica_waits_in_its_zone(
        ray_cp: RayControlPlane, lab: Lab) -> None:
    wait_ready(ray_cp.running, 3)
    az_b = lab.config.host("az-b").address
    seen_down: list[FleetView] = []
    with ray_cp.running.client() as client:
        # enough load that az-b's replica has streams in flight when its node goes: with 32-token streams
        # about three were in flight fleet-wide, and once none was on az-b's replica at t0 (affected 0 of 66)
        started = client.drill_run("node-loss", zones=["az-b"], rate=6.0, duration_s=12.0, fault_at_s=4.0,
                                   max_tokens=128)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            report = client.drill(started.id)
            if report.status in FINISHED:
                break
            view = client.fleet()
            if view.zones_down:
                seen_down.append(view)
            time.sleep(0.5)
        document = dict(client.drill(started.id).document)
        events = client.events(limit=5000)
    fig = document.get("figures") or {}
    print(f"\nnode-loss of az-b: status {document['status']}, RTO_service {fig.get('rto_service_s')} s, "
          f"RTO_slo {fig.get('rto_slo_s')} s, RTO_capacity {fig.get('rto_capacity_s')} s, affected "
          f"{fig.get('requests_affected')} of {fig.get('requests_total')}, failed "
          f"{fig.get('requests_failed')}, tokens lost {fig.get('tokens_lost')}, resumed "
          f"{fig.get('requests_resumed')}")
    assert document["status"] in ("passed", "failed"), document.get("error") or document
    assert fig["requests_failed"] == 0 and fig["tokens_lost"] == 0 and fig["tokens_duplicated"] == 0
    assert fig["rto_service_s"] is not None and fig["rto_capacity_s"] is not None
    assert document["fault_targets"] == ["az-b-1"]
    assert fig["requests_affected"] >= 1  # streams were on az-b's replica when its node went

    # The loss was reported: an event, and the fleet's view while it lasted (a node down, its zone empty).
    t0 = document["t0"]
    lost = [e for e in events if e.kind == "node.lost" and e.ts >= t0]
    assert lost and lost[0].subject == az_b and lost[0].detail["replicas"] == ["az-b-1"]
    assert any(e.kind == "zone.down" and e.subject == "az-b" for e in events if e.ts >= t0)
    assert seen_down and seen_down[0].zones_down == ("az-b",)
    assert any(n.address == az_b and not n.alive for n in seen_down[0].nodes)
    # Policy "stay": no replica was started outside az-b for it, and az-b's came back on az-b's host.
    spawned = [e for e in events if e.kind == "replica.spawned" and e.ts >= t0]
    assert spawned and {e.detail["zone"] for e in spawned} == {"az-b"}
    assert_one_ready_replica_per_zone_host(
        poll(lambda: fleet(ray_cp), lambda v: v.ready_replicas == 3, timeout=120), lab)


def test_kill_9_of_the_control_plane_leaves_replicas_serving_and_the_next_up_adopts_every_actor(
        ray_cp: RayControlPlane, lab: Lab) -> None:
    wait_ready(ray_cp.running, 3)
    before = fleet(ray_cp)
    pids_before = {r.replica_id: r.pid for r in before.replicas}
    ray_cp.running.process.send_signal(signal.SIGKILL)
    ray_cp.running.process.wait(10)

    during = run_streams(ray_cp.running.gateway, 6, 8)  # the gateway serves on its last known replicas
    assert during == [8] * 6

    ray_cp.restart()
    wait_ready(ray_cp.running, 3)
    after = fleet(ray_cp)
    with ray_cp.running.client() as client:
        adopted = {e.subject for e in client.events(kind="replica.adopted", limit=1000)}
        restarted_at = min(e.ts for e in client.events(kind="replica.adopted", limit=1000))
        spawned = [e for e in client.events(kind="replica.spawned", limit=1000) if e.ts >= restarted_at]
    assert adopted == set(pids_before) and spawned == []
    assert {r.replica_id: r.pid for r in after.replicas} == pids_before  # the same processes, adopted
    assert_one_ready_replica_per_zone_host(after, lab)
    assert run_streams(ray_cp.running.gateway, 6, 8) == [8] * 6


def test_stopping_up_drains_every_replica_and_leaves_no_actor_or_replica_process(ray_cp: RayControlPlane,
                                                                                  lab: Lab) -> None:
    wait_ready(ray_cp.running, 3)
    ray_cp.running.process.send_signal(signal.SIGTERM)  # what Ctrl-C does
    assert ray_cp.running.process.wait(90) == 0
    left = [(host.name, cmd) for host in lab.config.hosts for pid in network.namespace_pids(host.namespace)
            if "ReplicaActor" in (cmd := cmdline(pid)) or " serve " in cmd]
    assert left == []
    with ray_cp.running.log.open() as log:
        stopped = [line for line in log if "-> stopped" in line]
    assert len(stopped) == 3
