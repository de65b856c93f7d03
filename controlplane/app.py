"""``controlplane up``: wire the store, fleet, gateway, telemetry, Prometheus and the REST API together.

Everything runs in one asyncio loop: the API server (127.0.0.1:8080), the gateway (127.0.0.1:8000), the
fleet's reconcile loop and the in-process scraper; replicas and Prometheus are child processes. SIGINT
or SIGTERM stops accepting new work, drains every replica and stops Prometheus, so no child survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import uvicorn

from chaos.catalogue import default_catalogue
from chaos.safety import FaultManager
from controlplane.api import Services, create_api
from controlplane.auth import Auditor, TokenAuthority
from controlplane.backends.local import LocalProcessBackend
from controlplane.config import Config
from controlplane.fleet import Fleet, load_or_create_secret
from controlplane.gateway import Gateway, create_gateway_app
from controlplane.prometheus import PrometheusServer
from controlplane.replicas import ReplicaLoad
from controlplane.store import Store
from controlplane.telemetry import Regex, Telemetry, TelemetryError, select_source
from controlplane.traces import TraceSampler

logger = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "CONTROLPLANE_ADMIN_TOKEN"


@dataclass
class ControlPlane:
    config: Config
    store: Store
    fleet: Fleet
    gateway: Gateway
    telemetry: Telemetry
    prometheus: PrometheusServer | None
    loads: LoadCache
    servers: list[uvicorn.Server] = field(default_factory=list)
    admin_token: str | None = None  # set only when this start created it


def build(config: Config) -> ControlPlane:
    state = config.state_path
    state.mkdir(parents=True, exist_ok=True)
    store = Store(state / "controlplane.db")
    tokens = TokenAuthority(store)
    secret, created = tokens.ensure_admin(os.environ.get(ADMIN_TOKEN_ENV) or config.api.admin_token or None)
    backend = LocalProcessBackend(log_dir=state / "logs", state_dir=state)
    fleet = Fleet(config.fleet, backend, store, secret=load_or_create_secret(state / "replica-admin.key"))
    prometheus = _prometheus(config)
    telemetry = select_source(config.telemetry, prometheus.url if prometheus else None, fleet.endpoints)
    fleet.error_rate = replica_error_rate(telemetry)
    sampler = TraceSampler(config.gateway.trace_sample_rate)
    loads = LoadCache(telemetry)
    gateway = Gateway(config.gateway, endpoints=fleet.endpoints, load=loads.get,
                      on_trace=lambda record: store.add_trace(record) if sampler.keep(record) else None,
                      on_event=lambda kind, rid, detail: _noted(store.add_event(f"gateway.{kind}", rid,
                                                                                {"detail": detail})))
    return ControlPlane(config, store, fleet, gateway, telemetry, prometheus, loads,
                        admin_token=secret if created else None)


def _noted(_: object) -> None:
    return None


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the control plane stops its servers itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _prometheus(config: Config) -> PrometheusServer | None:
    if config.prometheus.enabled == "off":
        return None
    api, gw = config.api, config.gateway
    server = PrometheusServer(config.prometheus, config.state_path / "prometheus",
                              static_jobs={"controlplane": [f"{api.host}:{api.port}"],
                                           "gateway": [f"{gw.host}:{gw.port}"]})
    if not server.is_available():
        if config.prometheus.enabled == "on":
            raise RuntimeError("unavailable: prometheus binary not found (install Debian's prometheus)")
        logger.warning("prometheus binary not found: using the in-process scraper for telemetry")
        return None
    return server


def replica_error_rate(telemetry: Telemetry) -> Callable[[str], float | None]:
    """A replica's share of 5xx answers to inference requests over the telemetry window."""
    def rate(replica_id: str) -> float | None:
        try:
            per_status = telemetry.rate("http_requests_total", by=("status_code",), match={
                "replica": replica_id, "path": Regex("/v1/(chat/)?completions")})
        except TelemetryError:
            return None
        total = sum(per_status.values())
        if not total:
            return None
        return sum(v for (code, *_), v in per_status.items() if code.startswith("5")) / total

    return rate


class LoadCache:
    """The replicas' latest loads for routing, refreshed off the event loop from telemetry."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.loads: dict[str, ReplicaLoad] = {}

    def get(self, replica_id: str) -> ReplicaLoad | None:
        return self.loads.get(replica_id)

    def refresh(self) -> None:
        try:
            self.loads = dict(self.telemetry.replica_loads())
        except Exception:  # routing falls back to the gateway's own in-flight counts
            logger.debug("replica loads unavailable", exc_info=True)


async def serve(cp: ControlPlane) -> None:
    cfg = cp.config
    if cp.prometheus is not None:
        await asyncio.to_thread(cp.prometheus.start)
        cp.fleet.on_change(cp.prometheus.update_targets)
    cp.telemetry.start()
    await cp.fleet.start()
    await cp.gateway.start()
    chaos = FaultManager(default_catalogue(admin_tokens=cp.fleet.admin_token), cp.store)
    leftovers = await chaos.revert_leftovers()  # a crash mid-drill leaves nothing paused or partitioned
    if leftovers:
        logger.warning("reverted %d faults left active by an earlier control plane", len(leftovers))
    services = Services(cp.fleet, cp.store, TokenAuthority(cp.store), Auditor(cp.store), cp.telemetry,
                        chaos)
    api = create_api(services)
    gateway_app = create_gateway_app(cp.gateway)
    cp.servers = [
        _Server(uvicorn.Config(api, host=cfg.api.host, port=cfg.api.port, log_level="warning",
                               lifespan="off")),
        _Server(uvicorn.Config(gateway_app, host=cfg.gateway.host, port=cfg.gateway.port,
                               log_level="warning", lifespan="off", timeout_graceful_shutdown=5)),
    ]
    _announce(cp)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(s.serve()) for s in cp.servers]
    tasks.append(asyncio.create_task(_refresh_loads(cp)))
    await stop.wait()
    logger.warning("stopping: draining replicas")
    for server in cp.servers:
        server.should_exit = True
    await chaos.halt_all()  # nothing injected outlives the control plane
    await chaos.aclose()
    await cp.gateway.stop()
    await cp.fleet.stop(drain=True)
    cp.telemetry.stop()
    if cp.prometheus is not None:
        cp.prometheus.stop()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    logger.warning("stopped")


async def _refresh_loads(cp: ControlPlane) -> None:
    while True:
        await asyncio.to_thread(cp.loads.refresh)
        await asyncio.sleep(cp.config.telemetry.scrape_interval_s)


def _announce(cp: ControlPlane) -> None:
    cfg = cp.config
    lines = [
        f"gateway (OpenAI API): http://{cfg.gateway.host}:{cfg.gateway.port}/v1",
        f"control plane API:    http://{cfg.api.host}:{cfg.api.port}  (OpenAPI: /docs)",
        f"prometheus:           {cp.prometheus.url if cp.prometheus else 'not running (in-process scraper)'}",
        f"state:                {cfg.state_path}",
        f"replicas:             {cfg.fleet.replicas} of model {cfg.fleet.model} "
        f"in {', '.join(cfg.fleet.zones)}",
    ]
    if cp.admin_token:
        lines.append(f"admin token (shown once; export CONTROLPLANE_TOKEN=...): {cp.admin_token}")
    print("\n".join(lines), flush=True)


def run_up(config: Config) -> int:
    cp = build(config)
    try:
        asyncio.run(serve(cp))
    except OSError as exc:
        print(f"controlplane: {exc}", file=sys.stderr)
        return 1
    return 0
