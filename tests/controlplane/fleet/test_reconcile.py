"""The fleet's reconcile rules, on a simulated backend and clock (no processes, no sleeps).

The backend here stands in for processes only to drive the decision logic through crash, backoff,
scale and rollout sequences deterministically; ``test_plan.py`` asserts on the plans alone and
``tests/controlplane/up/`` runs the fleet on real replica processes.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from controlplane.config import load_config
from controlplane.fleet.backends.base import ReplicaHandle, ReplicaSpec
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.reconcile import Fleet
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.store.database import ReplicaRow, Store


@dataclass
class SimBackend:
    places_replicas = False  # replicas listen where their spec says (as local processes do)
    next_pid: int = 1000
    running: set[int] = field(default_factory=set)
    draining: set[int] = field(default_factory=set)
    spawned: list[ReplicaSpec] = field(default_factory=list)

    def spawn(self, spec: ReplicaSpec) -> ReplicaHandle:
        self.next_pid += 1
        self.running.add(self.next_pid)
        self.spawned.append(spec)
        return ReplicaHandle(spec.replica_id, self.next_pid)

    def is_running(self, handle: ReplicaHandle) -> bool:
        return handle.pid in self.running

    def exit_status(self, handle: ReplicaHandle) -> int | None:
        return None if handle.pid in self.running else -9

    def drain(self, handle: ReplicaHandle) -> None:
        self.draining.add(handle.pid or 0)

    def kill(self, handle: ReplicaHandle) -> None:
        self.running.discard(handle.pid or 0)

    def adopt(self, spec: ReplicaSpec, pid: int | None) -> ReplicaHandle | None:
        return ReplicaHandle(spec.replica_id, pid) if pid in self.running else None

    def location(self, handle: ReplicaHandle) -> None:
        return None

    def nodes(self) -> tuple[()]:
        return ()

    def finish_drains(self) -> None:
        self.running -= self.draining
        self.draining.clear()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    fleet: Fleet
    backend: SimBackend
    clock: Clock
    store: Store
    unready: set[str] = field(default_factory=set)  # replica ids whose /ready fails
    errors: dict[str, float] = field(default_factory=dict)  # replica id -> 5xx share telemetry reports

    def tick(self, seconds: float = 0.5) -> None:
        self.clock.now += seconds
        asyncio.run(self.fleet.reconcile())

    def states(self) -> dict[str, str]:
        return {e.replica_id: e.state.value for e in self.fleet.endpoints()}

    def events(self, prefix: str) -> list[str]:
        return [f"{e.kind}:{e.subject}" for e in self.store.events(kind_prefix=prefix, limit=5000)]


def make(tmp_path: Path, reserved_ports: frozenset[int] = frozenset(), **overrides: object) -> Harness:
    config = FleetConfig(**{"replicas": 3, "base_port": 18101, **overrides})  # type: ignore[arg-type]
    store = Store(tmp_path / "cp.db")
    backend, clock = SimBackend(), Clock()
    harness: Harness

    async def probe(endpoint: ReplicaEndpoint) -> bool:
        return endpoint.replica_id not in harness.unready

    fleet = Fleet(config, backend, store, secret=b"s" * 32, clock=clock, ready_probe=probe,  # type: ignore[arg-type]
                  error_rate=lambda rid: harness.errors.get(rid), reserved_ports=reserved_ports)
    harness = Harness(fleet, backend, clock, store)
    return harness


def test_fresh_fleet_starts_one_replica_per_zone_and_marks_them_ready(tmp_path: Path) -> None:
    h = make(tmp_path)
    h.tick()  # spawn
    assert sorted(s.zone for s in h.backend.spawned) == ["az-a", "az-b", "az-c"]
    h.tick()  # probe
    assert set(h.states().values()) == {"ready"}
    assert h.fleet.num_ready() == 3
    assert len({s.port for s in h.backend.spawned}) == 3
    assert {r.replica_id for r in h.store.replicas()} == set(h.states())
    assert len(h.events("replica.spawned")) == 3 and len(h.events("replica.ready")) == 3


def test_a_failed_spawn_is_recorded_and_the_rest_of_the_plan_still_happens(tmp_path: Path) -> None:
    h = make(tmp_path)
    spawn = h.backend.spawn

    def refuse_zone_b(spec: ReplicaSpec) -> ReplicaHandle:
        if spec.zone == "az-b":
            raise OSError("fork failed: out of memory")
        return spawn(spec)

    h.backend.spawn = refuse_zone_b  # type: ignore[method-assign]
    h.tick()
    assert sorted(s.zone for s in h.backend.spawned) == ["az-a", "az-c"]
    [failed] = h.store.events(kind_prefix="fleet.action_failed")
    assert failed.subject == "az-b-1" and failed.detail == {"action": "Spawn",
                                                             "error": "OSError: fork failed: out of memory"}
    h.backend.spawn = spawn  # type: ignore[method-assign]
    h.tick()
    h.tick()
    assert h.states() == {"az-a-1": "ready", "az-b-1": "ready", "az-c-1": "ready"}


def test_replica_ports_skip_the_control_planes_own_listeners(tmp_path: Path) -> None:
    """Replicas spawn before the gateway and the API bind: a port scan alone would hand a replica the
    gateway's port when it lies in the replica range (seen in CI, where every port is chosen at random)."""
    h = make(tmp_path, reserved_ports=load_config().listener_ports | {18102, 18104})
    h.tick()
    assert sorted(s.port for s in h.backend.spawned) == [18101, 18103, 18105]
    assert load_config().listener_ports == {8000, 8050, 8080, 9090}


def test_replica_whose_port_was_taken_restarts_on_another_port(tmp_path: Path) -> None:
    h = make(tmp_path)
    h.tick()
    h.tick()
    victim = next(e for e in h.fleet.endpoints() if e.replica_id == "az-a-1")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", victim.port))
        squatter.listen()
        h.backend.running.discard(victim.pid or 0)
        h.tick(0.1)
        while h.states()["az-a-1"] == "crashed":
            h.tick(0.25)
        h.tick()
        moved = next(e for e in h.fleet.endpoints() if e.replica_id == "az-a-1")
    assert h.states()["az-a-1"] == "ready"
    assert moved.port != victim.port and moved.port not in {e.port for e in h.fleet.endpoints() if e != moved}
    assert h.backend.spawned[-1].port == moved.port
    assert h.events("replica.port_moved") == ["replica.port_moved:az-a-1"]
    assert [r.port for r in h.store.replicas() if r.replica_id == "az-a-1"] == [moved.port]  # adopted there


def test_crashed_replica_restarts_with_exponential_backoff_and_a_crash_loop_is_reported(
        tmp_path: Path) -> None:
    h = make(tmp_path, restart_backoff_s=1.0, restart_backoff_max_s=8.0, crash_loop_restarts=3)
    h.tick()
    h.tick()
    victim = "az-a-1"
    delays = []
    for _ in range(4):
        pid = next(e.pid for e in h.fleet.endpoints() if e.replica_id == victim)
        h.backend.running.discard(pid)
        h.tick(0.1)
        assert h.states()[victim] == "crashed"
        crashed_at = h.clock.now
        while h.states()[victim] == "crashed":
            h.tick(0.25)
        delays.append(round(h.clock.now - crashed_at))
        h.tick()
        assert h.states()[victim] == "ready"
    assert delays == [1, 2, 4, 8]
    assert any(e.startswith("replica.crash_loop:az-a-1") for e in h.events("replica.crash_loop"))


def test_scale_up_spreads_over_zones_and_scale_down_drains_before_removal(tmp_path: Path) -> None:
    h = make(tmp_path)
    h.tick()
    h.tick()
    h.fleet.scale(5)
    h.tick()
    h.tick()
    zones = [e.zone for e in h.fleet.endpoints()]
    assert sorted(zones) == ["az-a", "az-a", "az-b", "az-b", "az-c"]
    h.fleet.scale(2)
    h.tick()
    draining = [r for r, s in h.states().items() if s == "draining"]
    assert len(draining) == 3
    assert len(h.fleet.endpoints()) == 5  # still there until they exit
    h.backend.finish_drains()
    h.tick()
    assert len(h.fleet.endpoints()) == 2
    assert {r.replica_id for r in h.store.replicas()} == set(h.states())


def test_rolling_update_replaces_each_replica_after_its_successor_is_ready(tmp_path: Path) -> None:
    h = make(tmp_path, rollout_observe_s=1.0)
    h.tick()
    h.tick()
    h.fleet.start_rollout("/models/v2")
    for _ in range(40):
        h.tick()
        h.backend.finish_drains()
        if h.fleet.rollout is None:
            break
    assert h.fleet.model == "/models/v2" and h.fleet.generation == 1
    assert {e.model for e in h.fleet.endpoints()} == {"/models/v2"}
    assert len(h.fleet.endpoints()) == 3 and h.fleet.num_ready() == 3
    assert h.events("rollout.completed")


def test_rollout_rolls_back_when_the_new_replica_never_becomes_ready(tmp_path: Path) -> None:
    h = make(tmp_path, ready_timeout_s=5.0, rollout_observe_s=1.0)
    h.tick()
    h.tick()
    h.unready.update({"az-a-2", "az-b-2", "az-c-2"})  # any new replica fails readiness
    h.fleet.start_rollout("/models/broken")
    for _ in range(20):
        h.tick()
        h.backend.finish_drains()
    assert h.fleet.rollout is None and h.fleet.model == "default"
    assert {e.model for e in h.fleet.endpoints()} == {"default"}
    assert h.fleet.num_ready() == 3
    assert h.events("rollout.rolled_back")


@pytest.mark.parametrize("on_restart", ["adopt", "stop"])
def test_restarted_control_plane_adopts_or_stops_what_it_finds(tmp_path: Path, on_restart: str) -> None:
    first = make(tmp_path)
    first.tick()
    first.tick()
    rows = first.store.replicas()
    dead = rows[0]
    first.backend.running.discard(dead.pid or 0)  # this one died with the old control plane
    second = make(tmp_path, on_restart=on_restart)
    second.backend.running = set(first.backend.running)
    second.backend.next_pid = 2000  # new processes get pids the old ones never had
    second.fleet.adopt_or_clean()
    survivors = {r.replica_id for r in rows} - {dead.replica_id}
    if on_restart == "adopt":
        assert set(second.states()) == survivors
        second.tick()
        assert all(second.states()[r] == "ready" for r in survivors)
        assert not [s for s in second.backend.spawned if s.replica_id in survivors]
        assert [s.zone for s in second.backend.spawned] == [dead.zone]  # the lost one is replaced
    else:
        assert second.states() == {} and second.backend.running == set()
        assert len(second.events("replica.orphan_stopped")) == 2
    assert dead.pid not in {r.pid for r in second.store.replicas()}
    assert second.events("replica.gone") == [f"replica.gone:{dead.replica_id}"]


def test_replica_row_round_trips_through_the_store(tmp_path: Path) -> None:
    store = Store(tmp_path / "x.db")
    store.upsert_replica(ReplicaRow("az-a-1", "az-a", "127.0.0.1", 8101, 42, ReplicaState.READY, "default"))
    [row] = store.replicas()
    assert (row.replica_id, row.pid, row.state) == ("az-a-1", 42, ReplicaState.READY)


def test_acknowledged_scale_and_rollout_survive_a_restart_of_the_control_plane(tmp_path: Path) -> None:
    first = make(tmp_path)
    first.tick()
    first.fleet.scale(5)
    first.fleet.start_rollout("/models/v2")
    second = make(tmp_path)  # same store file, config still says 3 replicas of "default"
    second.fleet.adopt_or_clean()
    assert second.fleet.desired_total == 5
    assert second.fleet.rollout is not None and second.fleet.rollout.model == "/models/v2"
    assert second.events("fleet.restored")


def test_rollout_rolls_back_when_the_new_replica_errors_more_than_the_old_ones(tmp_path: Path) -> None:
    h = make(tmp_path, rollout_observe_s=5.0)
    h.tick()
    h.tick()
    h.errors.update({"az-a-1": 0.01, "az-b-1": 0.0, "az-c-1": 0.02, "az-a-2": 0.30})
    h.fleet.start_rollout("/models/v2-bad")
    for _ in range(10):
        h.tick()
        h.backend.finish_drains()
    assert h.fleet.rollout is None and h.fleet.model == "default"
    [event] = h.store.events(kind_prefix="rollout.rolled_back")
    assert "30.0%" in event.detail["reason"] and "2.0%" in event.detail["reason"]
    assert {e.model for e in h.fleet.endpoints()} == {"default"} and h.fleet.num_ready() == 3


def test_a_model_is_built_before_its_first_replica_but_never_for_adopted_replicas(tmp_path: Path) -> None:
    """At a fresh start the model is built before the spawns; after a restart the adopted replicas run it
    already, so the pass that marks them ready does not wait on a build (clients would find none ready)."""
    built: list[str] = []
    first = make(tmp_path)
    first.fleet.prepare_model = built.append
    asyncio.run(first.fleet._prepare_models())
    first.tick()
    first.tick()
    assert built == ["default"]
    second = make(tmp_path)
    second.backend.running = set(first.backend.running)
    second.fleet.prepare_model = built.append
    second.fleet.adopt_or_clean()
    asyncio.run(second.fleet._prepare_models())
    assert built == ["default"]  # not built again: adopted replicas serve it
    second.fleet.start_canary("v2", "/models/v2")
    asyncio.run(second.fleet._prepare_models())
    assert built == ["default", "/models/v2"]  # a canary's new model is built before its replica
