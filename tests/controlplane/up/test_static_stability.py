"""Static stability: the data plane serves through a control plane's death and is adopted when it returns.

A real ``controlplane up``; 50 concurrent greedy streams through the gateway with the official ``openai``
client; a 10 s pause of one replica injected, then ``kill -9`` of the control plane mid-stream; requests
sent while it is down; ``controlplane up`` again after 20 s. What a user must see: no failed stream, each
equal to its undisturbed output; requests during the outage served; the pause reverted on time although no
control plane was there to revert it; the next control plane adopting the same gateway and replicas.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from chaos.faults.process import process_state

from .conftest import Running, gateway_pids, replica_pids, shutdown, start, wait_ready, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_STREAMS = 50
MAX_TOKENS = 48
OUTAGE_S = 20.0
STOPPED = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP}
RUNNING = {psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING, psutil.STATUS_DISK_SLEEP}
PAUSE_S = 10.0
EXPIRY_SLACK_S = 5.0  # the guard reverts at expiry; a busy 2-core machine may take a few seconds to run it
DURING_OUTAGE = 4


def prompt(i: int) -> str:
    return f"Request {i}: what keeps serving when the control plane is gone?"


async def one_stream(client: openai.AsyncOpenAI, i: int, progress: list[int]) -> str:
    text = []
    stream = await client.completions.create(model="default", prompt=prompt(i), max_tokens=MAX_TOKENS,
                                             temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            progress[i] += 1
    return "".join(text)


async def streams(gateway: str, on_flowing: threading.Event | None = None) -> list[str | BaseException]:
    progress = [0] * NUM_STREAMS
    async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0,
                                  timeout=300) as client:
        tasks = [asyncio.create_task(one_stream(client, i, progress)) for i in range(NUM_STREAMS)]
        if on_flowing is not None:
            while sum(p > 2 for p in progress) < NUM_STREAMS // 2 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.02)
            on_flowing.set()
        return await asyncio.gather(*tasks, return_exceptions=True)


def complete(gateway: str, i: int) -> str:
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0, timeout=120) as client:
        answer = client.completions.create(model="default", prompt=prompt(i), max_tokens=MAX_TOKENS,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    return answer.choices[0].text


def test_the_data_plane_serves_through_a_kill_9_of_the_control_plane(model_state: Path) -> None:
    config = write_config(model_state)
    first = start(config, model_state, "admin-token-for-tests")
    second: Running | None = None
    try:
        wait_ready(first, 3)
        reference = asyncio.run(streams(first.gateway))
        assert all(isinstance(r, str) for r in reference), [r for r in reference if not isinstance(r, str)]
        gateways_before, replicas_before = gateway_pids(first.state_dir), replica_pids(first.state_dir)
        assert len(gateways_before) == 1 and len(replicas_before) == 3
        with first.client() as client:
            victim = next(r for r in client.fleet().replicas if r.zone == "az-b")
        assert victim.pid is not None

        flowing = threading.Event()
        results: list[str | BaseException] = []
        load = threading.Thread(target=lambda: results.extend(asyncio.run(streams(first.gateway, flowing))))
        load.start()
        assert flowing.wait(120), "the streams never got going"
        with first.client() as client:
            client.chaos_inject("pause", replicas=[victim.replica_id], duration_s=PAUSE_S)
        paused_at = time.monotonic()
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
        killed_at = time.monotonic()

        assert process_state(victim.pid) in STOPPED  # the fault is in place, and no control plane
        during = [complete(first.gateway, 1000 + i) for i in range(DURING_OUTAGE)]
        deadline = paused_at + PAUSE_S + EXPIRY_SLACK_S
        while time.monotonic() < deadline and process_state(victim.pid) in STOPPED:
            time.sleep(0.1)
        late = time.monotonic() - paused_at
        assert process_state(victim.pid) in RUNNING, \
            f"az-b's replica still paused {late:.1f}s after a {PAUSE_S:g}s pause, control plane down"
        assert time.monotonic() < killed_at + OUTAGE_S  # that was seen while the control plane was down
        time.sleep(max(killed_at + OUTAGE_S - time.monotonic(), 0.0))

        second = start(config, model_state, "admin-token-for-tests")
        wait_ready(second, 3)
        with second.client() as client:
            replicas_after = {r.pid for r in client.fleet().replicas}
        listed = httpx.get(f"{second.api}/api/v1/gateways", timeout=10,
                           headers={"authorization": f"Bearer {second.token}"}).json()
        gateways_after = {g["pid"] for g in listed}
        load.join(300)
        assert not load.is_alive()
    finally:
        if second is not None:
            shutdown(second)
        shutdown(first, leftovers=lambda: gateway_pids(first.state_dir))

    failures = [r for r in results if not isinstance(r, str)]
    assert failures == [], failures[:3]
    assert results == reference  # each stream equals its undisturbed greedy output
    assert all(len(text) > 0 for text in during)
    assert replicas_after == replicas_before  # the same replica processes, adopted
    assert gateways_after == gateways_before  # the same gateway process, adopted
    assert gateway_pids(first.state_dir) == set() and replica_pids(first.state_dir) == set()  # Ctrl-C
