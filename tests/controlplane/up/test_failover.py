"""A replica killed under load: the client loses nothing and the fleet restores its capacity by itself."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from .conftest import Running, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

NUM_STREAMS = 50
MAX_TOKENS = 64


def body(i: int) -> dict[str, object]:
    return {"prompt": f"Request {i}: describe a failover drill.", "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True}


async def stream(client: httpx.AsyncClient, i: int, progress: list[int]) -> str:
    text = []
    async with client.stream("POST", "/v1/completions", json=body(i)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text.append(chunk["choices"][0]["text"])
                progress[i] += 1
    return "".join(text)


async def run_all(gateway: str, on_flowing: object = None) -> list[str | BaseException]:
    progress = [0] * NUM_STREAMS
    async with httpx.AsyncClient(base_url=gateway, timeout=120, trust_env=False,
                                 limits=httpx.Limits(max_connections=NUM_STREAMS + 10)) as client:
        tasks = [asyncio.create_task(stream(client, i, progress)) for i in range(NUM_STREAMS)]
        if on_flowing is not None:
            while sum(p > 3 for p in progress) < NUM_STREAMS // 2:
                await asyncio.sleep(0.02)
            on_flowing()  # type: ignore[operator]
        return await asyncio.gather(*tasks, return_exceptions=True)


def test_kill_9_of_a_replica_under_50_streams_loses_no_request_and_capacity_returns(running: Running) -> None:
    wait_ready(running, 3)
    reference = asyncio.run(run_all(running.gateway))
    assert all(isinstance(r, str) for r in reference), [r for r in reference if not isinstance(r, str)]

    with running.client() as client:
        victim = max(client.fleet().replicas, key=lambda r: r.replica_id)
    killed_at: list[float] = []

    def kill() -> None:
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        killed_at.append(time.time())

    results = asyncio.run(run_all(running.gateway, kill))
    failures = [r for r in results if not isinstance(r, str)]
    assert failures == [], failures[:3]
    assert results == reference  # every stream equals its undisturbed greedy output

    wait_ready(running, 3)
    with running.client() as client:
        fleet = client.fleet()
        resumed = client.events(kind="gateway.resumed", limit=1000)
        ready_again = [e for e in client.events(kind="replica.ready", limit=1000)
                       if e["subject"] == victim.replica_id and e["ts"] > killed_at[0]]
    assert fleet.ready_replicas == 3 and ready_again
    assert next(r for r in fleet.replicas if r.replica_id == victim.replica_id).pid != victim.pid
    print(f"killed {victim.replica_id}: {len(resumed)} streams resumed elsewhere, 0 failed; capacity "
          f"(3 ready replicas) restored {ready_again[0]['ts'] - killed_at[0]:.2f}s after the kill")
