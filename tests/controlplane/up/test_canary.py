"""Canary releases on a real ``controlplane up`` (two stable replicas, one gateway, real replicas):

- a canary slower per token (a token-latency fault on the canary's replica only) aborts at its first
  analysis step; the stable version's clients see no change; within 5 s of the decision no request goes
  to the canary any more;
- a canary of an identical model promotes through every step, and the stable fleet ends up on its model.

The load is closed-loop streaming through the gateway; each request's served replica is read from the
gateway's ``x-replica-id`` header, its time per output token from the stream.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from chaos.drill_bench import quiet_base_port
from controlplane.client import FleetView, ReleaseView
from inference.launcher import free_port
from tests.polling import wait_until

from .conftest import Running, shutdown, start, wait_ready

pytestmark = [pytest.mark.exclusive, pytest.mark.slow, pytest.mark.timeout(420)]

TOKEN = "admin-token-for-canaries"
CONCURRENT = 4
TOKENS = 12
STEP_S = 5.0
SLOW_TOKEN_S = 0.08  # the canary's extra seconds per token: several times a step's usual time per token
SPLIT_SETTLES_S = 5.0


def write_config(tmp: Path) -> Path:
    config = tmp / "canary.toml"
    config.write_text(f"""
state_dir = "{tmp / 'state'}"
[api]
port = {free_port()}
[gateway]
port = {free_port()}
[fleet]
replicas = 2
zones = ["az-a", "az-b"]
base_port = {quiet_base_port(8)}
rollout_observe_s = 1.0
[prometheus]
port = {free_port()}
scrape_interval_s = 1.0
[alerts]
enabled = false
[autoscaler]
enabled = false
[console]
enabled = false
""")
    return config


@dataclass
class Served:
    started: float
    replica: str
    ok: bool
    tpot_s: float | None


@dataclass
class Load:
    """Closed-loop streams through the gateway, each recorded with the replica that served it."""

    gateway: str
    stop: threading.Event = field(default_factory=threading.Event)
    served: list[Served] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def _client(self, i: int) -> None:
        n = 0
        with httpx.Client(base_url=self.gateway, timeout=60, trust_env=False) as http:
            while not self.stop.is_set():
                n += 1
                started = time.monotonic()
                body = {"model": "default", "prompt": f"conversation {i}-{n} about the replica",
                        "stream": True, "max_tokens": TOKENS, "ignore_eos": True}
                arrivals: list[float] = []
                try:
                    with http.stream("POST", "/v1/completions", json=body) as r:
                        replica = r.headers.get("x-replica-id", "")
                        for line in r.iter_lines():
                            if line.startswith("data: {") and '"text"' in line:
                                arrivals.append(time.monotonic())
                    ok = r.status_code == 200 and len(arrivals) >= 2
                except httpx.HTTPError:
                    replica, ok = "", False
                tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else None
                self.served.append(Served(started, replica, ok, tpot))

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(CONCURRENT)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, model_state: Path) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("canary")
    (tmp / "state").mkdir()
    (tmp / "state" / "models").symlink_to(model_state / "state" / "models")  # the default model, built once
    running = start(write_config(tmp), tmp, TOKEN)
    try:
        wait_ready(running, 2)
        yield running
    finally:
        shutdown(running)


def same_model_in(folder: Path, model_state: Path) -> str:
    """A new folder of the default model's weights, named ``default`` so clients' model name is served."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "default"
    if not link.exists():
        link.symlink_to(model_state / "state" / "models" / "default-v2", target_is_directory=True)
    return str(link)


def finished(running: Running, release_id: int, timeout: float) -> ReleaseView:
    def latest() -> ReleaseView | None:
        with running.client() as c:
            release = c.rollouts().release
        return release if release is not None and release.id == release_id and \
            release.outcome in ("promoted", "aborted") else None
    result = wait_until(latest, timeout=timeout, what=f"release {release_id} to end")
    assert result is not None
    return result


def canary_replica(running: Running, version: str) -> str:
    def ready() -> str | None:
        with running.client() as c:
            fleet = c.fleet()
        mine = [r for r in fleet.replicas if r.state == "ready" and r.replica_id not in stable_ids(running)]
        return mine[0].replica_id if mine else None
    rid = wait_until(ready, timeout=120, what=f"the {version} canary's replica to be ready")
    assert rid is not None
    return rid


_STABLE: dict[str, set[str]] = {}


def stable_ids(running: Running) -> set[str]:
    return _STABLE.setdefault(running.api, set())


def test_a_slower_canary_aborts_at_its_first_step_and_stable_clients_see_no_change(
        fleet: Running, model_state: Path, tmp_path: Path) -> None:
    with fleet.client() as c:
        stable_ids(fleet).update(r.replica_id for r in c.fleet().replicas)
        c.add_version("v1", "default")
        c.add_version("v2-slow", same_model_in(tmp_path / "v2-slow", model_state))
    with Load(fleet.gateway) as load:
        time.sleep(STEP_S)  # the stable version's own figures, before any canary
        baseline_until = time.monotonic()
        with fleet.client() as c:
            release = c.start_canary("v2-slow", steps=[20, 50, 100], interval_s=STEP_S, min_samples=10)
        canary = canary_replica(fleet, "v2-slow")
        with fleet.client() as c:  # slower per token, on the canary's replica only
            c.chaos_inject("token_latency", duration_s=120, selector="ALL",
                           params={"seconds": SLOW_TOKEN_S}, replicas=[canary])
        ended = finished(fleet, release.id, timeout=90)
        decided = time.monotonic()
        time.sleep(SPLIT_SETTLES_S + 2)
    analyses = ended.analyses
    assert ended.outcome == "aborted", ended
    # Its first step (20%) decides: at once, or after a window short of samples ("extend").
    assert {a["share"] for a in analyses} == {0.2} and analyses[-1]["decision"] == "abort"
    assert all(a["decision"] == "extend" for a in analyses[:-1])
    tpot = next(m for m in analyses[-1]["metrics"] if m["metric"] == "tpot")
    assert tpot["verdict"] == "fail" and tpot["candidate"]["p50"] > tpot["baseline"]["p50"]
    served = load.served
    on_canary = [s for s in served if s.replica == canary]
    assert on_canary, "the canary's share reached its replica"
    step_at = next(st["at"] for st in ended.steps if st.get("event") == "step")
    aborted_at = next(st["at"] for st in ended.steps if st.get("event") == "aborted")
    last = max(s.started for s in on_canary)
    print(f"slow canary: step start -> abort decision {aborted_at - step_at:.1f} s "
          f"({len(analyses)} analysis windows of {STEP_S:g} s); last request sent to it "
          f"{last - decided:+.1f} s after the test saw the decision")
    late = [s for s in on_canary if s.started > decided + SPLIT_SETTLES_S]
    assert late == [], f"{len(late)} requests went to the aborted canary more than 5 s after the decision"
    before = [s.tpot_s for s in served if s.ok and s.tpot_s and s.started < baseline_until]
    during = [s.tpot_s for s in served if s.ok and s.tpot_s and s.replica in stable_ids(fleet)
              and baseline_until <= s.started <= decided]
    assert before and during
    assert statistics.median(during) < 2 * statistics.median(before), (statistics.median(before),
                                                                        statistics.median(during))
    assert all(s.ok for s in served if s.replica in stable_ids(fleet))
    with fleet.client() as c:
        view = c.rollouts()
        assert not view.plan.get("split") and view.current == "v1"


def test_an_identical_canary_promotes_through_every_step(fleet: Running, model_state: Path,
                                                         tmp_path: Path) -> None:
    with fleet.client() as c:
        for f in c.chaos_faults():
            c.chaos_revert(f.id)
        c.add_version("v3", same_model_in(tmp_path / "v3", model_state))
    with Load(fleet.gateway) as load:
        with fleet.client() as c:
            # A version equal to the stable one. Three replicas share two cores here, which costs the canary
            # up to ~20 ms of TTFT against the stable ones (measured: 33.7 vs 25.1 and 37.5 vs 20.8 ms);
            # a step fails only on 50 ms or more, still far under the slow canary's 80 ms per token.
            release = c.start_canary("v3", steps=[20, 50, 100], interval_s=STEP_S, min_samples=10,
                                     min_latency_increase_s=0.05)
        ended = finished(fleet, release.id, timeout=240)
    assert ended.outcome == "promoted", ended
    first = next(st["at"] for st in ended.steps if st.get("event") == "step")
    promoting = next(st["at"] for st in ended.steps if st.get("event") == "promoting")
    print(f"identical canary: steps 20/50/100% passed in {promoting - first:.1f} s, promoted (rolling update "
          f"of the stable fleet) {ended.ended - promoting if ended.ended else float('nan'):.1f} s later")
    assert [(a["share"], a["decision"]) for a in ended.analyses] == [(0.2, "next"), (0.5, "next"),
                                                                   (1.0, "next")]
    assert all(s.ok for s in load.served), [s for s in load.served if not s.ok][:5]
    with fleet.client() as c:
        view, fleet_view = c.rollouts(), c.fleet()
    assert view.current == "v3" and not view.plan.get("split")
    assert fleet_view.model.endswith("/v3/default")
    wait_until(lambda: len([r for r in _fleet(fleet).replicas if r.state == "ready"]) == 2, timeout=60,
               what="the canary's replica to drain once promoted")


def _fleet(running: Running) -> FleetView:
    with running.client() as c:
        return c.fleet()
