"""The canary controller against a fake fleet and fake gateway outcomes (real registry, real store, real
analysis): a slower canary aborts at its first step and its share goes back to 0; an identical one
promotes through every step; too little traffic extends a step, then aborts; operators steer it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane.fleet.plan import Canary, Rollout
from controlplane.gateway.slices import Outcome
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.rollouts.canary import CanaryConflict, CanaryController, CanaryPolicy, CanaryRefused
from controlplane.rollouts.traffic import TrafficSlices
from controlplane.rollouts.versions import VersionRegistry
from controlplane.store.database import Store


class FakeFleet:
    def __init__(self) -> None:
        self.model = "default"
        self.rollout: Rollout | None = None
        self.canary: Canary | None = None
        self.rollouts: list[str] = []

    def endpoints(self) -> list[ReplicaEndpoint]:
        eps = [ReplicaEndpoint("az-a-1", "az-a", "127.0.0.1", 8101, ReplicaState.READY, self.model)]
        if self.canary is not None:
            eps.append(ReplicaEndpoint("az-a-2", "az-a", "127.0.0.1", 8102, ReplicaState.READY,
                                       self.canary.model, labels=(("version", self.canary.version),)))
        return eps

    def start_canary(self, version: str, model: str, replicas: int = 1) -> Canary:
        self.canary = Canary(version, model, replicas)
        return self.canary

    def end_canary(self) -> None:
        self.canary = None

    def start_rollout(self, model: str) -> Rollout:
        self.rollouts.append(model)
        self.model = model  # the update completes at once here
        return Rollout(model, 1, "default", 0, 0.0)


def _sample(n: int, ttft: float, tpot: float, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    return [Outcome(float(i), True, rng.lognormvariate(0, 0.2) * ttft, rng.lognormvariate(0, 0.2) * tpot)
            for i in range(n)]


def _source(stable: list[Outcome], canary: Callable[[], list[Outcome]]) -> Callable[..., object]:
    async def outcomes(since: float) -> dict[str, dict[str, list[Outcome]]]:
        return {"gw-0": {"version:stable": stable, "version:v2": canary()}}
    return outcomes


def _controller(tmp_path: Path, canary: Callable[[], list[Outcome]]) -> tuple[CanaryController, FakeFleet]:
    store = Store(tmp_path / "state.db")
    registry = VersionRegistry(store)
    registry.add("v1", "default")
    registry.set_current("v1")
    registry.add("v2", "/models/v2")
    fleet = FakeFleet()
    traffic = TrafficSlices(store, _source(_sample(300, 0.05, 0.02, 1), canary))  # type: ignore[arg-type]
    ticks = iter(range(10**9))

    async def no_wait(_: float) -> None:
        await asyncio.sleep(0)

    controller = CanaryController(fleet, registry, traffic, clock=lambda: float(next(ticks)),
                                  wall=lambda: 1000.0, sleep=no_wait)
    return controller, fleet


POLICY = CanaryPolicy(steps=(0.05, 0.2, 0.5, 1.0), interval_s=1.0, max_extensions=1, warmup_s=0.0)


async def _finish(controller: CanaryController) -> None:
    assert controller.run is not None and controller.run.task is not None
    await asyncio.wait_for(controller.run.task, 10)


def test_a_slower_canary_aborts_at_its_first_step_and_its_share_returns_to_zero(tmp_path: Path) -> None:
    async def main() -> None:
        controller, fleet = _controller(tmp_path, lambda: _sample(60, 0.05, 0.2, 2))  # 10x per token
        release = controller.start("v2", POLICY)
        await _finish(controller)
        assert release.outcome == "aborted" and "tpot" in release.reason
        analyses = [s for s in release.steps if s.get("event") == "analysis"]
        assert len(analyses) == 1 and analyses[0]["share"] == 0.05 and analyses[0]["decision"] == "abort"
        assert analyses[0]["metrics"][2]["candidate"]["p50"] > analyses[0]["metrics"][2]["baseline"]["p50"]
        assert controller.traffic.plan().share_of("v2") == 0.0 and fleet.canary is None
        assert controller.registry.current() == "v1" and fleet.rollouts == []
        assert controller.registry.releases()[0].outcome == "aborted"  # saved

    asyncio.run(main())


def test_an_identical_canary_promotes_through_every_step(tmp_path: Path) -> None:
    async def main() -> None:
        controller, fleet = _controller(tmp_path, lambda: _sample(60, 0.05, 0.02, 3))
        release = controller.start("v2", POLICY)
        await _finish(controller)
        decisions = [(s["share"], s["decision"]) for s in release.steps if s.get("event") == "analysis"]
        assert decisions == [(0.05, "next"), (0.2, "next"), (0.5, "next"), (1.0, "next")]
        assert release.outcome == "promoted"
        assert fleet.rollouts == ["/models/v2"] and fleet.canary is None
        assert controller.traffic.plan().split == ()
        assert controller.registry.current() == "v2"
        assert controller.registry.get("v2").last_analysis is not None

    asyncio.run(main())


def test_a_step_short_of_traffic_extends_then_aborts(tmp_path: Path) -> None:
    async def main() -> None:
        controller, _ = _controller(tmp_path, lambda: _sample(5, 0.05, 0.02, 4))
        release = controller.start("v2", POLICY)
        await _finish(controller)
        decisions = [s["decision"] for s in release.steps if s.get("event") == "analysis"]
        assert decisions == ["extend", "abort"]
        assert release.outcome == "aborted"

    asyncio.run(main())


def test_operators_pause_promote_and_are_refused_a_second_release(tmp_path: Path) -> None:
    async def main() -> None:
        controller, fleet = _controller(tmp_path, lambda: _sample(60, 0.05, 0.02, 5))
        slow = replace(POLICY, interval_s=3600.0)
        release = controller.start("v2", slow)
        with pytest.raises(CanaryConflict):
            controller.start("v2", slow)
        controller.command(release.id, "pause")
        assert release.outcome == "paused"
        controller.command(release.id, "resume")
        controller.command(release.id, "promote", "looks good")
        await _finish(controller)
        assert release.outcome == "promoted" and release.reason == "looks good"
        assert fleet.model == "/models/v2"
        with pytest.raises(CanaryRefused):
            CanaryPolicy(steps=(0.5, 0.2, 1.0))
        with pytest.raises(CanaryRefused, match="last step"):
            CanaryPolicy(steps=(0.1, 0.5))

    asyncio.run(main())


def test_a_release_left_running_by_a_killed_control_plane_is_aborted_at_start(tmp_path: Path) -> None:
    controller, fleet = _controller(tmp_path, lambda: [])
    fleet.start_canary("v2", "/models/v2")
    release = controller.registry.begin_release("v2", "v1", "canary")
    controller.traffic.set_split("v2", 0.2)
    controller.recover()
    assert controller.registry.releases()[0].outcome == "aborted"
    assert controller.traffic.plan().share_of("v2") == 0.0 and fleet.canary is None
    assert release.id == controller.registry.releases()[0].id
