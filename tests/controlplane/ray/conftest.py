"""A real multi-host lab (one network namespace per zone, a real Ray cluster in them) and a real
``controlplane up`` on the Ray backend, shared by the tests of one module.

The lab is built once per module and torn down by the fixture's finalizer, also when a test fails; the
control plane joins it as a Ray Client, as a user would (``[fleet] backend = "ray"``). The tests need root
(namespaces, a bridge) and Ray; where either is missing they are skipped with "unavailable: <reason>".
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from controlplane.lab import network
from controlplane.lab.lab import Lab
from inference.launcher import free_port
from tests.controlplane.up.conftest import Running, model_state, shutdown, start, wait_ready

__all__ = ["model_state"]

TOKEN = "admin-token-for-ray-tests"


def lab_unavailable() -> str | None:
    reason = network.unavailable_reason()
    if reason is None:
        try:
            import ray  # noqa: F401
        except ImportError:
            reason = "Ray is not installed (pip install '.[ray]' or '.[dev]')"
    return reason


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    reason = lab_unavailable()
    if reason:
        pytest.skip(f"unavailable: {reason}")
    built = Lab()
    try:
        started = time.monotonic()
        status = built.up()
        print(f"\nlab up in {time.monotonic() - started:.1f}s: Ray's processes hold "
              f"{status.rss_bytes / 2**20:.0f} MiB resident")
        yield built
    finally:
        built.down()


def ray_config(tmp: Path, lab: Lab, *, replicas: int = 3, on_node_loss: str = "stay") -> Path:
    """A control plane on free ports whose fleet runs on the lab's Ray cluster; the loops that would move
    the fleet under the tests (autoscaler, alerts) and the console are off."""
    config = tmp / "ray.toml"
    config.write_text(f"""
state_dir = "{tmp / 'state'}"
[api]
port = {free_port()}
[gateway]
port = {free_port()}
# Every request sent to a replica that is then killed before its first token spends retry budget (a request
# that breaks replicas must not reach them all): at the default 0.2, a kill with more than 6 of 30 streams
# still waiting on the victim left the surplus a 503, as designed. These tests are about the fleet, not that
# budget (tests/controlplane/gateway has its own), so any request may be retried once.
retry_budget_ratio = 1.0
[fleet]
replicas = {replicas}
base_port = {free_port() + 100}
backend = "ray"
ray_address = "{lab.config.ray_address}"
on_node_loss = "{on_node_loss}"
[prometheus]
port = {free_port()}
scrape_interval_s = 1.0
[autoscaler]
enabled = false
[alerts]
enabled = false
[console]
enabled = false
""")
    return config


@dataclass
class RayControlPlane:
    """The module's control plane; ``running`` changes when a test restarts it."""

    running: Running
    config: Path
    tmp: Path

    def restart(self) -> None:
        self.running = start(self.config, self.tmp, TOKEN)


@pytest.fixture(scope="module")
def ray_cp(lab: Lab, model_state: Path) -> Iterator[RayControlPlane]:
    config = ray_config(model_state, lab)
    cp = RayControlPlane(start(config, model_state, TOKEN), config, model_state)
    try:
        seconds = wait_ready(cp.running, 3)
        print(f"3 Ray replicas ready {seconds:.1f}s after start")
        yield cp
    finally:
        shutdown(cp.running)


# ---- load ------------------------------------------------------------------------------------------
async def _stream(client: httpx.AsyncClient, i: int, max_tokens: int, progress: list[int]) -> int:
    body = {"prompt": f"Request {i}: what happens when a node is lost?", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                progress[i] += 1
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def _streams(gateway: str, n: int, max_tokens: int,
                   on_flowing: Callable[[], None] | None) -> list[int | BaseException]:
    progress = [0] * n
    async with httpx.AsyncClient(base_url=gateway, timeout=180, trust_env=False,
                                 limits=httpx.Limits(max_connections=n + 10)) as client:
        tasks = [asyncio.create_task(_stream(client, i, max_tokens, progress)) for i in range(n)]
        if on_flowing is not None:
            while sum(p > 2 for p in progress) < n // 2 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.02)
            await asyncio.to_thread(on_flowing)
        return await asyncio.gather(*tasks, return_exceptions=True)


def run_streams(gateway: str, n: int, max_tokens: int,
                on_flowing: Callable[[], None] | None = None) -> list[int | BaseException]:
    """``n`` concurrent greedy streams through the gateway; ``on_flowing`` runs once half of them are
    generating. Each result is the stream's completion tokens (its usage), or its exception."""
    return asyncio.run(_streams(gateway, n, max_tokens, on_flowing))


# ---- the machine -----------------------------------------------------------------------------------
def root_listeners() -> list[tuple[str, int | None]]:
    """Every listening TCP socket of the root network namespace: (local address, owning pid)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        pid = re.search(r"pid=(\d+)", line)
        found.append((fields[3], int(pid.group(1)) if pid else None))
    return found


def cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def is_ray_process(pid: int) -> bool:
    """A process of Ray's own (raylet, GCS, workers, agents, the client server), by name and command."""
    try:
        process = psutil.Process(pid)
        name, command = process.name(), " ".join(process.cmdline())
    except psutil.Error:
        return False
    return name in ("raylet", "gcs_server") or name.startswith("ray::") or command.startswith("ray::") \
        or "site-packages/ray/" in command or " -m ray." in command or "/bin/ray " in command
