"""``controlplane up``: wire the store, fleet, gateway, telemetry, Prometheus and the REST API together.

Everything runs in one asyncio loop: the API server (127.0.0.1:8080), the gateway (127.0.0.1:8000), the
fleet's reconcile loop and the in-process scraper; replicas and Prometheus are child processes. SIGINT
or SIGTERM stops accepting new work, drains every replica and stops Prometheus, so no child survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import uvicorn

from chaos.catalogue import default_catalogue
from chaos.drills import DrillRunner
from chaos.safety import FaultManager
from controlplane.alerts.delegation import delegated_rules_path
from controlplane.alerts.engine import alert_delegation, build_engine, rule_file_writer, rule_switches
from controlplane.api.auth import ADMIN_PASSWORD_ENV, FIRST_ADMIN_NAME, USERS_ENV, ensure_users, parse_users
from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, TokenAuthority
from controlplane.autoscale.loop import Autoscaler
from controlplane.client import TOKEN_ENV
from controlplane.config import Config, ConfigError
from controlplane.drills.port import FleetDrillPort
from controlplane.drills.service import DrillService
from controlplane.fleet.backends.local import LocalProcessBackend
from controlplane.fleet.reconcile import Fleet, load_or_create_secret
from controlplane.gateway.handler import Gateway
from controlplane.gateway.server import create_gateway_app
from controlplane.replicas import ReplicaLoad
from controlplane.schedules.scheduler import drill_scheduler
from controlplane.store.database import Store
from controlplane.telemetry.base import Regex, Telemetry, TelemetryError
from controlplane.telemetry.prometheus import PrometheusServer
from controlplane.telemetry.select import select_source
from controlplane.traces import TraceSampler

logger = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "CONTROLPLANE_ADMIN_TOKEN"
CONSOLE_SECRET_ENV = "CONTROLPLANE_CONSOLE_SECRET"  # read by ``python -m dashboards``


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
    admin_password: str | None = None  # the first console admin's password, set only when generated now
    console: subprocess.Popen[bytes] | None = None


def build(config: Config) -> ControlPlane:
    state = config.state_path
    state.mkdir(parents=True, exist_ok=True)
    store = Store(state / "controlplane.db")
    tokens = TokenAuthority(store)
    secret, created = tokens.ensure_admin(os.environ.get(ADMIN_TOKEN_ENV) or config.api.admin_token or None)
    backend = LocalProcessBackend(log_dir=state / "logs", state_dir=state)
    fleet = Fleet(config.fleet, backend, store, secret=load_or_create_secret(state / "replica-admin.key"),
                  reserved_ports=config.listener_ports)
    prometheus = _prometheus(config, rule_switches(store))
    telemetry = select_source(config.telemetry, prometheus.url if prometheus else None, fleet.endpoints)
    fleet.error_rate = replica_error_rate(telemetry)
    sampler = TraceSampler(config.gateway.trace_sample_rate)
    loads = LoadCache(telemetry)
    gateway = Gateway(config.gateway, endpoints=fleet.endpoints, load=loads.get,
                      on_trace=lambda record: store.add_trace(record) if sampler.keep(record) else None,
                      on_event=lambda kind, rid, detail: _noted(store.add_event(f"gateway.{kind}", rid,
                                                                                {"detail": detail})))
    return ControlPlane(config, store, fleet, gateway, telemetry, prometheus, loads,
                        admin_token=secret if created else None, admin_password=_console_users(config, store))


def _console_users(config: Config, store: Store) -> str | None:
    """Configured console users into the store, and a first admin user (its password when generated)."""
    try:
        entries = parse_users(config.console.users, os.environ)
    except ValueError as exc:
        raise ConfigError(f"console.users: {exc}") from exc
    return ensure_users(store, entries, os.environ.get(ADMIN_PASSWORD_ENV) or config.console.admin_password
                        or None)


def start_console(cp: ControlPlane) -> subprocess.Popen[bytes] | None:
    """The console as a child process (``python -m dashboards``): it talks to the API like any client, and
    the layers forbid the control plane to import it. Its session secret is fresh for every start."""
    cfg = cp.config
    if not cfg.console.enabled:
        return None
    if not _port_is_free(cfg.console.host, cfg.console.port):
        logger.warning("console not started: %s:%s is in use", cfg.console.host, cfg.console.port)
        return None
    api_host = "127.0.0.1" if cfg.api.host in ("0.0.0.0", "") else cfg.api.host
    command = [sys.executable, "-m", "dashboards", "--api", f"http://{api_host}:{cfg.api.port}",
               "--host", cfg.console.host, "--port", str(cfg.console.port),
               "--refresh-s", str(cfg.console.refresh_s), "--session-ttl-s", str(cfg.console.session_ttl_s)]
    # The secret goes in the environment (ps shows argv); the operator's own tokens and passwords do not:
    # the console acts only with each logged-in user's token.
    withheld = {TOKEN_ENV, ADMIN_TOKEN_ENV, ADMIN_PASSWORD_ENV, USERS_ENV}
    env = {k: v for k, v in os.environ.items() if k not in withheld}
    env[CONSOLE_SECRET_ENV] = secrets.token_urlsafe(32)
    log_dir = cfg.state_path / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "console.log", "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def stop_console(process: subprocess.Popen[bytes] | None, timeout_s: float = 5.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout_s)


def _noted(_: object) -> None:
    return None


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the control plane stops its servers itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _prometheus(config: Config, switches: Mapping[str, bool]) -> PrometheusServer | None:
    if config.prometheus.enabled == "off":
        return None
    api, gw = config.api, config.gateway
    server = PrometheusServer(config.prometheus, config.state_path / "prometheus",
                              static_jobs={"controlplane": [f"{api.host}:{api.port}"],
                                           "gateway": [f"{gw.host}:{gw.port}"]},
                              **alert_delegation(config.alerts, config.state_path, switches))
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
    chaos = FaultManager(default_catalogue(admin_tokens=cp.fleet.admin_token, link=cp.gateway.toxics),
                         cp.store)
    leftovers = await chaos.revert_leftovers()  # a crash mid-drill leaves nothing paused or partitioned
    if leftovers:
        logger.warning("reverted %d faults left active by an earlier control plane", len(leftovers))
    drill_port = FleetDrillPort(cp.fleet, cp.store, gateway=cfg.gateway, state_path=cfg.state_path,
                                inflight=cp.gateway.inflight)
    drills = DrillService(DrillRunner(drill_port, chaos), cp.store, cfg.state_path,
                          loop=asyncio.get_running_loop())
    drills.mark_interrupted()  # a report left "running" by a crash mid-drill
    alerts = build_engine(cfg.alerts, store=cp.store, auditor=Auditor(cp.store), telemetry=cp.telemetry,
                          fleet=cp.fleet, abort_drill=abort_running_drill(drills))
    if cp.prometheus is not None and cfg.alerts.alertmanager_url:  # it evaluates the rules: keep it in step
        alerts.on_rules_changed = rule_file_writer(delegated_rules_path(cfg.state_path), cp.prometheus.reload)
    services = Services(cp.fleet, cp.store, TokenAuthority(cp.store), Auditor(cp.store), cp.telemetry,
                        chaos, alerts=alerts, drills=drills)
    autoscaler = services.autoscaler = Autoscaler(cfg.autoscaler, cp.fleet, cp.telemetry, cp.store)
    schedules = services.schedules = drill_scheduler(cfg.drills, cp.store, drills,
                                                     loop=asyncio.get_running_loop())
    await asyncio.to_thread(schedules.start)  # before the API answers, so it lists the stored schedules
    api = create_api(services)
    gateway_app = create_gateway_app(cp.gateway)
    cp.servers = [
        _Server(uvicorn.Config(api, host=cfg.api.host, port=cfg.api.port, log_level="warning",
                               lifespan="off")),
        _Server(uvicorn.Config(gateway_app, host=cfg.gateway.host, port=cfg.gateway.port,
                               log_level="warning", lifespan="off", timeout_graceful_shutdown=5)),
    ]
    cp.console = start_console(cp)
    # What start-up built lives as long as the process; out of the collector's reach, a full collection
    # scans only what requests allocate and does not stall the gateway's streams for tens of ms.
    gc.freeze()
    _announce(cp)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(s.serve()) for s in cp.servers]
    tasks.append(asyncio.create_task(_refresh_loads(cp)))
    if cfg.alerts.enabled:
        tasks.append(asyncio.create_task(alerts.run(), name="alerts"))
    if cfg.autoscaler.enabled:
        autoscaler.start()
    await stop.wait()
    alerts.stop()  # no alert action (a replica restart) while the fleet drains
    # no scheduled drill while the fleet drains; a firing waiting for a running drill gives up
    await asyncio.to_thread(schedules.shutdown, cfg.drills.schedule_shutdown_timeout_s)
    await autoscaler.stop()  # no scaling while the fleet drains
    logger.warning("stopping: draining replicas")
    await asyncio.to_thread(stop_console, cp.console)
    for server in cp.servers:
        server.should_exit = True
    await drills.aclose()  # a running drill aborts: its load stops and its faults are reverted
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


def abort_running_drill(drills: DrillService) -> Callable[[str], str]:
    """The alert action ``abort_drill``: abort whatever drill runs now (its faults are reverted)."""
    def abort(reason: str) -> str:
        drill_id = drills.running_id
        if drill_id is None or not drills.abort(drill_id):
            return "no drill was running"
        logger.warning("aborting drill %s: %s", drill_id, reason)
        return f"drill {drill_id}"

    return abort


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
    if cp.console is not None:
        lines.append(f"console:              http://{cfg.console.host}:{cfg.console.port}")
    if cp.admin_password:
        lines.append(f"console user {FIRST_ADMIN_NAME}, password (shown once): {cp.admin_password}")
    print("\n".join(lines), flush=True)


def run_up(config: Config) -> int:
    cp = build(config)
    try:
        asyncio.run(serve(cp))
    except OSError as exc:
        print(f"controlplane: {exc}", file=sys.stderr)
        return 1
    return 0
