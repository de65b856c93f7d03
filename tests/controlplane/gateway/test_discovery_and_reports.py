"""A gateway process's two conversations with the control plane, against the control plane's real routes
(``controlplane.api.gateways`` with the real token checks and store, served in this process):

- the replica set: a long poll that answers as soon as the set changes; kept in memory and on disk; kept
  when the control plane is gone; taken from the disk by a gateway started while it is down; replaced
  whatever its version when the control plane comes back as a new run (a new epoch);
- the reports: traces and events delivered in batches, kept while the control plane is unreachable, and
  an overflow counted and delivered as a ``gateway.reports_dropped`` event, never dropped silently.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from controlplane.api.gateways import gateways_router
from controlplane.api.guards import install
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.fleet.feed import EndpointsFeed
from controlplane.fleet.gateways import gateway_token
from controlplane.gateway.discovery import Discovery
from controlplane.gateway.reports import Reports
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.store.database import Store
from controlplane.traces import TraceRecord, TraceSampler

SECRET = b"s" * 32
API = "http://control-plane"


class Gateways:
    """The supervisor as the routes need it: the gateways' service tokens."""

    def service_tokens(self) -> dict[str, str]:
        return {"gw-0": gateway_token(SECRET, "gw-0", "service")}

    def status(self) -> list[dict[str, object]]:
        return []

    async def set_admission(self, changes: Mapping[str, float | int]) -> dict[str, object]:
        return {"admission": dict(changes), "applied": []}


class Switch(httpx.AsyncBaseTransport):
    """The control plane's routes in this process, or nobody answering (``down``)."""

    def __init__(self, app: FastAPI) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.down = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


def endpoint(rid: str, state: ReplicaState = ReplicaState.READY) -> ReplicaEndpoint:
    return ReplicaEndpoint(rid, "az-a", "127.0.0.1", 8101 + int(rid[-1]), state, "default", pid=1000)


def control_plane(store: Store, fleet: list[ReplicaEndpoint]) -> tuple[FastAPI, EndpointsFeed]:
    feed = EndpointsFeed(lambda: list(fleet))
    app = FastAPI()
    install(app, TokenAuthority(store), Auditor(store))
    app.include_router(gateways_router(feed, Gateways(), store, Auditor(store)))
    return app, feed


def trace(i: int, e2e: float = 0.1) -> TraceRecord:
    return TraceRecord(f"req-{i}", time.time(), "/v1/completions", "default", 200, "r0", "az-a", "standard",
                       8, 4, 0.05, e2e, 0.001, 0.0, 0.01, 0.03, None, None)


def test_the_replica_set_is_watched_kept_on_disk_and_kept_when_the_control_plane_is_gone(
        store: Store, tmp_path: Path) -> None:
    fleet = [endpoint("r0"), endpoint("r1", ReplicaState.STARTING)]
    app, _ = control_plane(store, fleet)
    transport = Switch(app)
    token = gateway_token(SECRET, "gw-0", "service")

    async def scenario() -> None:
        discovery = Discovery(control_plane=API, token=token, state_dir=tmp_path, transport=transport,
                              wait_s=5.0)
        assert await discovery.poll_once(0)
        assert [e.replica_id for e in discovery.endpoints()] == ["r0", "r1"]
        first = discovery.snapshot.version
        waiting = asyncio.create_task(discovery.poll_once())  # a long poll: answered when the set changes
        await asyncio.sleep(0.3)
        assert not waiting.done()
        fleet[1] = endpoint("r1")  # r1 became ready
        started = time.monotonic()
        assert await asyncio.wait_for(waiting, 3.0)
        assert time.monotonic() - started < 1.0  # not the 5 s wait: the change answered it
        assert discovery.snapshot.version == first + 1
        assert {e.state for e in discovery.endpoints()} == {ReplicaState.READY}
        assert (tmp_path / "endpoints.json").stat().st_mode & 0o777 == 0o600

        transport.down = True  # the control plane is gone
        assert not await discovery.poll_once(0)
        assert not discovery.reachable and len(discovery.endpoints()) == 2  # still routing on them
        await discovery.stop()

        restarted = Discovery(control_plane=API, token=token, state_dir=tmp_path, transport=transport)
        assert not await restarted.poll_once(0)  # a gateway started while it is down...
        assert restarted.load_state()  # ...serves what the last one kept
        assert restarted.source == "disk" and {e.replica_id for e in restarted.endpoints()} == {"r0", "r1"}

        transport.down = False  # a new control plane: its own epoch, its versions from 1 again
        app2, _ = control_plane(store, [endpoint("r2")])
        transport.inner = httpx.ASGITransport(app=app2)
        assert await restarted.poll_once(0)
        assert [e.replica_id for e in restarted.endpoints()] == ["r2"] and restarted.source == "control-plane"
        await restarted.stop()

    asyncio.run(scenario())


def test_the_watch_refuses_strangers_and_takes_a_viewer(store: Store, tmp_path: Path) -> None:
    app, _ = control_plane(store, [endpoint("r0")])
    viewer = TokenAuthority(store).issue("alice", Role.VIEWER)

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=API) as http:
            anonymous = await http.get("/api/v1/gateway/endpoints")
            wrong = await http.get("/api/v1/gateway/endpoints", headers={"authorization": "Bearer nope"})
            seen = await http.get("/api/v1/gateway/endpoints", headers={"authorization": f"Bearer {viewer}"})
            report = await http.post("/api/v1/gateway/reports", json={"gateway": "gw-0"},
                                     headers={"authorization": f"Bearer {viewer}"})
        assert (anonymous.status_code, wrong.status_code, seen.status_code) == (401, 401, 200)
        assert report.status_code == 403  # only a gateway sends reports

    asyncio.run(scenario())


def test_reports_wait_for_the_control_plane_and_an_overflow_is_counted_not_lost(store: Store) -> None:
    app, _ = control_plane(store, [endpoint("r0")])
    transport = Switch(app)
    token = gateway_token(SECRET, "gw-0", "service")

    async def scenario() -> None:
        reports = Reports(gateway="gw-0", control_plane=API, token=token, sampler=TraceSampler(1.0),
                          max_traces=5, max_events=100, transport=transport)
        transport.down = True
        for i in range(8):
            reports.trace(trace(i))
        reports.event("ejected", "r0", "3 consecutive failures")
        with pytest.raises(httpx.HTTPError):
            await reports.deliver()
        assert reports.status()["buffered"] == {"traces": 5, "events": 1}  # the oldest 3 made room
        assert reports.dropped_total == {"traces": 3, "events": 0}

        transport.down = False
        assert await reports.deliver() == 6
        assert reports.status()["buffered"] == {"traces": 0, "events": 0}
        await reports.stop(flush=False)

    asyncio.run(scenario())
    kept = [t.request_id for t in store.traces(limit=100)]
    assert sorted(kept) == [f"req-{i}" for i in range(3, 8)]
    [ejected] = store.events(kind_prefix="gateway.ejected")
    assert ejected.subject == "r0" and ejected.detail["gateway"] == "gw-0"
    [dropped] = store.events(kind_prefix="gateway.reports_dropped")
    assert dropped.detail["dropped"] == {"traces": 3}


def test_a_closing_feed_answers_every_waiting_long_poll_at_once() -> None:
    """At Ctrl-C the API server waits for its open requests; a gateway's long poll must not be one."""
    feed = EndpointsFeed(lambda: [endpoint("r1")])
    first = feed.current()

    async def watch() -> float:
        started = time.monotonic()
        waiting = asyncio.create_task(feed.wait(epoch=first.epoch, after=first.version, wait_s=30))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # nothing changed: it waits
        feed.close()
        snapshot = await asyncio.wait_for(waiting, 5)
        assert snapshot.version == first.version
        return time.monotonic() - started

    assert asyncio.run(watch()) < 5
