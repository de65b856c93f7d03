"""Chaos against real replica processes: pause stops answers, hooks slow tokens, leftovers come back.

One replica (``python -m inference serve`` on one torch thread) is shared by the module; every test
leaves it running and fault-free, and the fixture always continues and stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from chaos.catalogue import default_catalogue
from chaos.faults.base import FaultSpec
from chaos.faults.process import STOPPED, process_state
from chaos.safety import BlastRadiusExceeded, FaultManager
from chaos.targets import Selector
from inference.launcher import ReplicaProcess, free_port
from inference.models.default import ensure_default_model

from .fakes import MemoryLedger

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "chaos-admin-token"
API_KEY = "chaos-api-key"
PROMPT = {"model": "default", "prompt": "The replica answers", "max_tokens": 6, "temperature": 0.0,
          "ignore_eos": True}


@dataclass(frozen=True)
class Replica:
    replica_id: str
    zone: str
    pid: int | None
    port: int
    admin_token: str | None

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/admin/faults"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Two replicas in two zones; always continued (in case a test left one paused) and stopped."""
    state = tmp_path_factory.mktemp("chaos-state")
    ensure_default_model(state)  # once, before two replicas would race to build it
    logs = Path(tmp_path_factory.mktemp("chaos-logs"))
    processes = [ReplicaProcess(port=free_port(), replica_id=f"chaos-{i}", zone=zone,
                                log_path=logs / f"chaos-{i}.log", env={"LLMSRE_STATE_DIR": str(state)},
                                extra_args=["--admin-token", ADMIN_TOKEN, "--api-key", API_KEY,
                                            "--num-threads", "1"])
                 for i, zone in enumerate(("az-a", "az-b"))]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.wait_ready(60)
        yield [Replica(p.replica_id, p.zone, p.process.pid if p.process else None, p.port, ADMIN_TOKEN)
               for p in processes]
    finally:
        for process in processes:
            if process.process is not None:
                with_continued(process.process.pid)
            process.stop(10)


@pytest.fixture
def replica(replicas: list[Replica]) -> Replica:
    return replicas[0]


def with_continued(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def answers(replica: Replica, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(f"{replica.base_url}/health", timeout=timeout, trust_env=False).status_code == 200
    except httpx.TimeoutException:
        return False


def timed_completion(replica: Replica) -> float:
    started = time.monotonic()
    response = httpx.post(f"{replica.base_url}/v1/completions", json=PROMPT, timeout=30, trust_env=False,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def replica_faults(replica: Replica) -> list[dict[str, object]]:
    response = httpx.get(replica.admin_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                         timeout=5, trust_env=False)
    assert response.status_code == 200
    faults: list[dict[str, object]] = response.json()["faults"]
    return faults


def manager(ledger: MemoryLedger) -> FaultManager:
    return FaultManager(default_catalogue(optional_modules=()), ledger)


def test_paused_replica_stops_answering_and_answers_again_after_revert(replica: Replica) -> None:
    assert replica.pid is not None
    ledger = MemoryLedger()

    async def scenario() -> None:
        chaos = manager(ledger)
        [active] = await chaos.inject(FaultSpec("pause", duration_s=60), [replica], allow_all=True)
        assert active.ok and active.fault_id is not None
        assert not await asyncio.to_thread(answers, replica, 1.0)
        result = await chaos.revert(active.fault_id)
        assert result.ok, result.detail
        await chaos.aclose()

    try:
        asyncio.run(scenario())
        assert answers(replica, 5.0)
        assert ledger.state(1) == "reverted"
    finally:
        with_continued(replica.pid)


def test_token_latency_slows_requests_until_reverted(replica: Replica) -> None:
    timed_completion(replica)  # warm-up: the first request of a fresh replica is the slowest
    baseline = min(timed_completion(replica), timed_completion(replica))
    ledger = MemoryLedger()
    spec = FaultSpec("token_latency", {"seconds": 0.25}, duration_s=60, selector=Selector.parse("ALL"))

    async def scenario() -> float:
        chaos = manager(ledger)
        [active] = await chaos.inject(spec, [replica])
        assert active.ok and active.fault_id is not None and active.token is not None
        assert [f["id"] for f in replica_faults(replica)] == [active.token.data["fault_id"]]
        slowed = await asyncio.to_thread(timed_completion, replica)
        assert (await chaos.revert(active.fault_id)).ok
        await chaos.aclose()
        return slowed

    try:
        slowed = asyncio.run(scenario())
        assert slowed > baseline + 1.0  # six steps (prefill and decodes) of 0.25 s each at the least
        assert replica_faults(replica) == []
        assert timed_completion(replica) < baseline + 1.0
    finally:
        httpx.delete(replica.admin_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, trust_env=False)


def test_pause_left_by_a_dead_manager_is_reverted_by_the_next_one(replica: Replica) -> None:
    assert replica.pid is not None
    ledger = MemoryLedger()

    async def scenario() -> None:
        first = manager(ledger)
        await first.inject(FaultSpec("pause", duration_s=600), [replica], allow_all=True)
        await first.aclose()  # dropped without reverting: only the ledger remembers
        assert process_state(replica.pid or 0) in STOPPED
        results = await manager(ledger).revert_leftovers()
        assert [r.ok for r in results] == [True]

    try:
        asyncio.run(scenario())
        assert process_state(replica.pid) not in (*STOPPED, None)
        assert answers(replica, 5.0)
        assert ledger.active_faults() == []
    finally:
        with_continued(replica.pid)


def test_halt_all_continues_every_paused_replica_and_blast_radius_holds(replicas: list[Replica]) -> None:
    ledger = MemoryLedger()

    async def scenario() -> float:
        chaos = manager(ledger)
        one = FaultSpec("pause", duration_s=60, selector=Selector.parse("COUNT(1)", seed=1))
        [paused] = await chaos.inject(one, replicas)
        others = [r.replica_id for r in replicas if r.replica_id != paused.target_id]
        rest = Selector.parse("ALL", replica_ids=others)
        with pytest.raises(BlastRadiusExceeded, match="all 2 replicas"):  # one is down already
            await chaos.inject(FaultSpec("pause", duration_s=60, selector=rest), replicas)
        await chaos.inject(FaultSpec("pause", duration_s=60, selector=rest), replicas, allow_all=True)
        assert not any(await asyncio.gather(*(asyncio.to_thread(answers, r, 1.0) for r in replicas)))
        started = time.monotonic()
        report = await chaos.halt_all()
        elapsed = time.monotonic() - started
        assert report.ok and sorted(report.reverted) == [1, 2]
        await chaos.aclose()
        return elapsed

    try:
        assert asyncio.run(scenario()) < 2.0
        assert all(answers(r, 5.0) for r in replicas)
        assert ledger.active_faults() == []
    finally:
        for r in replicas:
            with_continued(r.pid or 0)
