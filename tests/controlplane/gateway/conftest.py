"""Real replicas behind a real gateway, for the behaviour tests of this folder.

``fleet`` starts three replica processes per test module (``python -m inference serve``, one torch
thread each, fault hooks enabled) in a state folder where the default model was built once. The fleet
manager does not exist yet, so a small static provider turns the processes into endpoints (a process that
exited is CRASHED). ``serve_gateway(**config)`` serves a :class:`Gateway` over that fleet with uvicorn
on a free loopback port in a background thread and records its traces and events. No process outlives
its module: stopped replicas are continued and everything is killed at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.handler import Gateway
from controlplane.gateway.server import create_gateway_app
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.traces import TraceRecord
from inference.launcher import ReplicaProcess, free_port
from inference.models.default import ensure_default_model
from tests.polling import wait_until

ADMIN_TOKEN = "gateway-test-admin"
MODEL = "default"
READY_TIMEOUT_S = 90.0
REPLICA_IDS = ("r0", "r1", "r2")
ZONES = ("az-a", "az-b", "az-c")


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gateway-state")
    ensure_default_model(folder)  # once, before three replicas would race to build it
    return folder


class Fleet:
    """Three replica processes and the endpoint snapshot the gateway routes over."""

    def __init__(self, state_dir: Path, log_dir: Path) -> None:
        self.state_dir, self.log_dir = state_dir, log_dir
        self.replicas: dict[str, ReplicaProcess] = {}

    def start(self, replica_id: str, zone: str, port: int | None = None) -> ReplicaProcess:
        replica = ReplicaProcess(port or free_port(), replica_id=replica_id, zone=zone,
                                 extra_args=("--num-threads", "1", "--admin-token", ADMIN_TOKEN),
                                 env={"LLMSRE_STATE_DIR": str(self.state_dir)},
                                 log_path=self.log_dir / f"{replica_id}.log")
        self.replicas[replica_id] = replica.start()
        return replica

    def wait_ready(self) -> None:
        for replica in self.replicas.values():
            replica.wait_ready(READY_TIMEOUT_S)

    def restart(self, replica_id: str) -> None:
        """Start a replica that was killed again, on its old port."""
        old = self.replicas[replica_id]
        self.kill(replica_id)
        self.start(replica_id, old.zone, old.port).wait_ready(READY_TIMEOUT_S)

    def endpoints(self) -> list[ReplicaEndpoint]:
        return [ReplicaEndpoint(r.replica_id, r.zone, "127.0.0.1", r.port, _state(r), MODEL,
                                pid=r.process.pid if r.process else None) for r in self.replicas.values()]

    def pid(self, replica_id: str) -> int:
        process = self.replicas[replica_id].process
        assert process is not None
        return process.pid

    def signal(self, replica_id: str, sig: signal.Signals) -> None:
        os.kill(self.pid(replica_id), sig)

    def kill(self, replica_id: str) -> None:
        process = self.replicas[replica_id].process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)

    def admin(self, replica_id: str, method: str, body: dict[str, Any] | None = None) -> httpx.Response:
        url = f"{self.replicas[replica_id].base_url}/admin/faults"
        return httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                             timeout=10)

    def stop_all(self) -> None:
        for replica in self.replicas.values():
            if replica.process is not None and replica.process.poll() is None:
                replica.process.send_signal(signal.SIGCONT)  # a stopped process cannot drain
                replica.stop(timeout=10)


def _state(replica: ReplicaProcess) -> ReplicaState:
    alive = replica.process is not None and replica.process.poll() is None
    return ReplicaState.READY if alive else ReplicaState.CRASHED


@pytest.fixture(scope="module")
def fleet(state_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(state_dir, tmp_path_factory.mktemp("replica-logs"))
    try:
        for replica_id, zone in zip(REPLICA_IDS, ZONES):
            fleet.start(replica_id, zone)
        fleet.wait_ready()
        yield fleet
    finally:
        fleet.stop_all()


# ---- the gateway -----------------------------------------------------------------------------
@dataclass
class GatewayServer:
    """A gateway served by uvicorn on its own thread; what it reports is kept for the test."""

    gateway: Gateway
    port: int
    traces: list[TraceRecord] = field(default_factory=list)
    events: list[tuple[float, str, str, str]] = field(default_factory=list)
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayServer:
        config = uvicorn.Config(create_gateway_app(self.gateway), host="127.0.0.1", port=self.port,
                                log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)
        self.thread.start()
        wait_until(lambda: self.server is not None and self.server.started, timeout=10, what="gateway up")
        return self

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(15)

    def events_of(self, kind: str, replica_id: str | None = None) -> list[tuple[float, str, str, str]]:
        return [e for e in self.events if e[1] == kind and replica_id in (None, e[2])]


ServeGateway = Callable[..., GatewayServer]


@pytest.fixture
def serve_gateway(fleet: Fleet) -> Iterator[ServeGateway]:
    """``serve_gateway(stall_timeout_s=1.0, ...)``: a gateway over the module's fleet, for one test."""
    started: list[GatewayServer] = []

    def serve(**config: Any) -> GatewayServer:
        port = free_port()
        traces: list[TraceRecord] = []
        events: list[tuple[float, str, str, str]] = []
        gateway = Gateway(GatewayConfig(port=port, **config), endpoints=fleet.endpoints,
                          on_trace=traces.append, on_event=lambda *e: events.append((time.monotonic(), *e)))
        server = GatewayServer(gateway, port, traces, events).start()
        started.append(server)
        return server

    yield serve
    for server in started:
        server.stop()


# ---- clients ---------------------------------------------------------------------------------


def sse_payloads(text: str) -> list[Any]:
    return [_payload(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def _payload(data: str) -> Any:
    return data if data == "[DONE]" else json.loads(data)


@dataclass
class StreamResult:
    """One streaming request as a client saw it: each event with its arrival time."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    status: int | None = None
    replica: str | None = None  # x-replica-id: the replica the stream started on
    events: list[tuple[float, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def payloads(self) -> list[Any]:
        return [p for _, p in self.events]

    @property
    def is_done(self) -> bool:
        return bool(self.events) and self.events[-1][1] == "[DONE]"

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [p for p in self.payloads if isinstance(p, dict) and p.get("choices")]

    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c["choices"][0].get("token_ids", [])]

    def text(self) -> str:
        return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                       for c in self.chunks)

    def max_gap(self) -> float:
        times = [t for t, _ in self.events]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


async def stream(client: httpx.AsyncClient, result: StreamResult) -> StreamResult:
    try:
        async with client.stream("POST", result.path, json={**result.body, "stream": True},
                                 headers=result.headers) as response:
            result.status = response.status_code
            result.replica = response.headers.get("x-replica-id")
            if response.status_code != 200:
                result.error = (await response.aread()).decode()
                return result
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    result.events.append((time.monotonic(), _payload(line[6:])))
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_streams(url: str, results: list[StreamResult],
                      during: Callable[[list[StreamResult]], Awaitable[None]] | None = None
                      ) -> list[StreamResult]:
    """All ``results`` streamed at once through the gateway at ``url``; ``during`` runs alongside."""
    limits = httpx.Limits(max_connections=len(results) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, trust_env=False) as client:
        tasks = [asyncio.create_task(stream(client, r)) for r in results]
        if during is not None:
            await during(results)
        await asyncio.gather(*tasks)
    return results


def completion(prompt: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, **fields}


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16,
            "temperature": 0.0, **fields}
