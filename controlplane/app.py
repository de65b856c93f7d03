"""``controlplane up``: wire the store, fleet, gateways, telemetry, Prometheus and the REST API together.

The control plane's own asyncio loop runs the API server (127.0.0.1:8080), the fleet's reconcile loop,
the gateway supervisor, the autoscaler, the alert rules, the drill schedules and the in-process scraper.
The data plane runs beside it, not in it: the gateways (127.0.0.1:8000, :mod:`controlplane.gateway.process`)
and the replicas are processes in sessions of their own, which go on serving when the control plane dies
and are adopted by the next ``controlplane up``. SIGINT or SIGTERM stops accepting new work, drains the
gateways and the replicas and stops Prometheus and the console, so no child survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import uvicorn

from chaos.catalogue import default_catalogue
from chaos.drills import DrillRunner
from chaos.expiry import ExpiryGuards
from chaos.safety import FaultManager
from controlplane.alerts.delegation import delegated_rules_path, write_rule_file
from controlplane.alerts.engine import (
    AlertEngine,
    alert_delegation,
    build_engine,
    rule_file_writer,
    rule_switches,
)
from controlplane.api.auth import ADMIN_PASSWORD_ENV, FIRST_ADMIN_NAME, ensure_users, parse_users
from controlplane.api.factory import Services, create_api
from controlplane.api.process_metrics import STATE_PATH
from controlplane.api.state_metrics import ActiveFaultCount
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.autoscale.loop import Autoscaler
from controlplane.autoscale.profile import resolve_profile_path
from controlplane.config import STATE_DIR_ENV, Config, ConfigError
from controlplane.console import ConsoleProcess, start_console, stop_console
from controlplane.drills.port import FleetDrillPort, fleet_targets
from controlplane.drills.service import DrillService
from controlplane.fleet.backends.select import replica_backend
from controlplane.fleet.cluster import fleet_cluster
from controlplane.fleet.feed import EndpointsFeed
from controlplane.fleet.gateways import GatewaySupervisor
from controlplane.fleet.models import ensure_bundled_model
from controlplane.fleet.reconcile import Fleet
from controlplane.fleet.registry import load_or_create_secret
from controlplane.gateway.process import listening_socket
from controlplane.lab.hosts import LabHosts
from controlplane.replicas import ReplicaLoad
from controlplane.rollouts.canary import CanaryController
from controlplane.rollouts.experiment import SliceExperiments
from controlplane.rollouts.traffic import TrafficSlices
from controlplane.rollouts.versions import VersionRegistry
from controlplane.schedules.scheduler import DrillScheduler, drill_scheduler
from controlplane.store.database import Store
from controlplane.store.files import create_private, private_dir
from controlplane.store.retention import Retention
from controlplane.telemetry.base import HTTP_REQUESTS, Regex, Telemetry, TelemetryError
from controlplane.telemetry.prometheus_server import GuardedPage, PrometheusServer
from controlplane.telemetry.recording_rules import rule_file as recording_rule_file
from controlplane.telemetry.recording_rules import rule_file_path
from controlplane.telemetry.select import select_source
from inference.environment import child_environment

logger = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "CONTROLPLANE_ADMIN_TOKEN"
SCRAPE_TOKEN_NAME = "prometheus-scrape"  # the viewer token Prometheus shows /metrics/state; new at each start
SCRAPE_TOKEN_FILE = "scrape.token"  # in Prometheus' state folder, 0600
GATEWAY_READY_TIMEOUT_S = 60.0


@dataclass
class ControlPlane:
    config: Config
    store: Store
    fleet: Fleet
    gateways: GatewaySupervisor
    feed: EndpointsFeed
    telemetry: Telemetry
    prometheus: PrometheusServer | None
    loads: LoadCache
    servers: list[uvicorn.Server] = field(default_factory=list)
    admin_token: str | None = None  # set only when this start created it
    admin_password: str | None = None  # the first console admin's password, set only when generated now
    console: ConsoleProcess | None = None
    slices: TrafficSlices | None = None  # the traffic slices the gateways apply (rollouts/traffic.py)


def build(config: Config) -> ControlPlane:
    state = config.state_path
    private_dir(state)  # 0700: it holds the store (token and password hashes), secrets and logs
    store = Store(state / "controlplane.db", max_rows=config.retention.traces_max_rows)
    tokens = TokenAuthority(store)
    secret, created = tokens.ensure_admin(os.environ.get(ADMIN_TOKEN_ENV) or config.api.admin_token or None)
    fleet_secret = load_or_create_secret(state / "replica-admin.key")
    gateways = GatewaySupervisor(config.gateway, api_url=api_url(config), state_dir=state, store=store,
                                 secret=fleet_secret, reserved_ports=config.listener_ports)
    backend = replica_backend(config.fleet, state)  # joins the Ray cluster when [fleet] backend = "ray"
    fleet = Fleet(config.fleet, backend, store, secret=fleet_secret,
                  reserved_ports=config.listener_ports | {g.admin_port for g in gateways.gateways.values()},
                  tracing=config.gateway.tracing(),
                  # local replicas share this state folder: a bundled model is built once, before they start
                  prepare_model=partial(ensure_bundled_model, state_dir=state)
                  if config.fleet.backend == "local" else None)
    prometheus = _prometheus(config, rule_switches(store), gateways.admin_addresses, tokens)
    telemetry = select_source(config.telemetry, prometheus.url if prometheus else None, fleet.endpoints,
                              prometheus_scrape_s=config.prometheus.scrape_interval_s)
    fleet.error_rate = replica_error_rate(telemetry)
    loads = LoadCache(telemetry)
    slices = TrafficSlices(store, gateways.slice_outcomes)  # canary split and experiment colours
    feed = EndpointsFeed(fleet.endpoints, loads.get, slices=slices.plan)
    return ControlPlane(config, store, fleet, gateways, feed, telemetry, prometheus, loads,
                        admin_token=secret if created else None, admin_password=_console_users(config, store),
                        slices=slices)


def api_url(config: Config) -> str:
    """The API as the control plane's own children (gateways, console) call it."""
    host = "127.0.0.1" if config.api.host in ("0.0.0.0", "") else config.api.host
    return f"http://{host}:{config.api.port}"


def _console_users(config: Config, store: Store) -> str | None:
    """Configured console users into the store, and a first admin user (its password when generated)."""
    try:
        entries = parse_users(config.console.users, os.environ)
    except ValueError as exc:
        raise ConfigError(f"console.users: {exc}") from exc
    return ensure_users(store, entries, os.environ.get(ADMIN_PASSWORD_ENV) or config.console.admin_password
                        or None)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the control plane stops its servers itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _prometheus(config: Config, switches: Mapping[str, bool], gateways: list[str],
                tokens: TokenAuthority) -> PrometheusServer | None:
    if config.prometheus.enabled == "off":
        return None
    api = config.api
    delegation = alert_delegation(config.alerts, config.state_path, switches)
    recording = rule_file_path(config.state_path)  # the dashboard's quantiles (deploy/grafana/)
    write_rule_file(recording, recording_rule_file())
    state = config.state_path / "prometheus"
    state_page = GuardedPage(STATE_PATH, state / SCRAPE_TOKEN_FILE)  # the control plane's state: viewer only
    server = PrometheusServer(config.prometheus, state,
                              static_jobs={"controlplane": [f"{api.host}:{api.port}"], "gateway": gateways},
                              guarded_pages={"controlplane": state_page},
                              rule_files=[recording, *delegation.pop("rule_files", [])], **delegation)
    if not server.is_available():
        if config.prometheus.enabled == "on":
            raise RuntimeError("unavailable: prometheus binary not found (install Debian's prometheus)")
        logger.warning("prometheus binary not found: using the in-process scraper for telemetry")
        return None
    write_scrape_token(tokens, state_page.credentials_file)
    return server


def write_scrape_token(tokens: TokenAuthority, path: Path) -> None:
    """A new viewer token for Prometheus' scrape of ``/metrics/state``, in a file only this user may read
    (Prometheus reads it at each scrape); the previous start's token is revoked. The secret is neither
    logged nor printed."""
    tokens.revoke(SCRAPE_TOKEN_NAME)
    secret = tokens.issue(SCRAPE_TOKEN_NAME, Role.VIEWER)
    private_dir(path.parent)
    path.unlink(missing_ok=True)
    create_private(path, secret.encode("ascii"))


def replica_error_rate(telemetry: Telemetry) -> Callable[[str], float | None]:
    """A replica's share of 5xx answers to inference requests over the telemetry window."""
    def rate(replica_id: str) -> float | None:
        try:
            per_status = telemetry.rate(HTTP_REQUESTS, by=("status_code",), match={
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


@dataclass
class _Running:
    """What ``serve`` has started so far, so that a start that fails half-way stops exactly that."""

    prometheus: bool = False
    telemetry: bool = False
    fleet: bool = False
    chaos: FaultManager | None = None
    drills: DrillService | None = None
    alerts: AlertEngine | None = None
    schedules: DrillScheduler | None = None
    autoscaler: Autoscaler | None = None
    canary: CanaryController | None = None
    experiments: SliceExperiments | None = None
    gateways: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


async def serve(cp: ControlPlane) -> None:
    """Start everything, serve until SIGINT or SIGTERM, then stop everything. The API's address is taken
    before anything starts (a port in use fails at once, with nothing to clean up), and a start that fails
    later stops what it had started: no child is left either way."""
    cfg = cp.config
    api_socket = listening_socket(cfg.api.host, cfg.api.port, reuse_port=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running = _Running()
    try:
        await _start(cp, running, api_socket)
        await stop.wait()
    finally:
        await _stop(cp, running)


async def _start(cp: ControlPlane, running: _Running, api_socket: socket.socket) -> None:
    cfg = cp.config
    if cp.prometheus is not None:
        await asyncio.to_thread(cp.prometheus.start)
        running.prometheus = True
        cp.fleet.on_change(cp.prometheus.update_targets)
    cp.telemetry.start()
    running.telemetry = True
    await cp.fleet.start()
    running.fleet = True
    # On Ray, the node faults act on the cluster; the lab, when this machine has one, brings hosts back.
    cluster = fleet_cluster(cp.fleet.backend, LabHosts.find())
    ledger = ActiveFaultCount(cp.store)  # the ledger, counted as it is written: /metrics/state reads no SQL
    chaos = running.chaos = FaultManager(
        default_catalogue(admin_tokens=cp.fleet.admin_token, link=cp.gateways.links, cluster=cluster),
        # the guards carry this state folder in their environment, as the replicas do: which control
        # plane's guard a process is (a crash drill's orphan count) is read from there
        ledger, guards=ExpiryGuards(environment=partial(child_environment,
                                                        {STATE_DIR_ENV: str(cfg.state_path)})))
    leftovers = await chaos.revert_leftovers()  # a crash mid-drill leaves nothing paused or partitioned
    if leftovers:
        logger.warning("reverted %d faults left active by an earlier control plane", len(leftovers))
    experiments = running.experiments = None if cp.slices is None else \
        SliceExperiments(cp.slices, chaos, partial(fleet_targets, cp.fleet), cp.store)  # on coloured slices
    drill_port = FleetDrillPort(cp.fleet, cp.store, gateway=cfg.gateway, state_path=cfg.state_path,
                                inflight=cp.gateways.inflight, refresh_inflight=cp.gateways.refresh_state,
                                kill_gateway=cp.gateways.kill_one,
                                slice_experiment=experiments.run_to_end if experiments else None)
    drills = running.drills = DrillService(DrillRunner(drill_port, chaos), cp.store, cfg.state_path,
                                           loop=asyncio.get_running_loop(), api_url=api_url(cfg))
    drills.mark_interrupted()  # a report left "running" by a crash mid-drill
    alerts = running.alerts = build_engine(cfg.alerts, store=cp.store, auditor=Auditor(cp.store),
                                           telemetry=cp.telemetry, fleet=cp.fleet,
                                           abort_drill=abort_running_drill(drills))
    if cp.prometheus is not None and cfg.alerts.alertmanager_url:  # it evaluates the rules: keep it in step
        alerts.on_rules_changed = rule_file_writer(delegated_rules_path(cfg.state_path), cp.prometheus.reload)
    services = Services(cp.fleet, cp.store, TokenAuthority(cp.store), Auditor(cp.store), cp.telemetry,
                        chaos, alerts=alerts, drills=drills, feed=cp.feed, gateways=cp.gateways,
                        experiment_hosts=tuple(cfg.chaos.experiment_hosts), api=cfg.api,
                        active_faults=ledger, experiments=experiments,
                        what_if_priority=cfg.simulator.cpu_priority)
    # the profile `controlplane calibrate` measured on this host, unless the config names one
    scaling = replace(cfg.autoscaler, replica_profile=resolve_profile_path(
        cfg.autoscaler.replica_profile, cfg.state_path, cpu_decode_kernel=cfg.fleet.cpu_decode_kernel,
        packed_weights=cfg.fleet.packed_weights))
    services.autoscaler = running.autoscaler = Autoscaler(scaling, cp.fleet, cp.telemetry, cp.store,
                                                          refused=cp.gateways.refusals.rate,
                                                          inflight_limit=cp.gateways.max_inflight_per_replica)
    if (measured := services.autoscaler.profile.cpu_limit) != cfg.fleet.replica_cpu_limit:
        logger.warning("the replica profile was measured with CPU limit %s, the fleet runs its replicas "
                       "with %s: the autoscaler sizes for replicas of another speed (calibrate again)",
                       "none" if measured is None else f"{measured:g}",
                       "none" if cfg.fleet.replica_cpu_limit is None else f"{cfg.fleet.replica_cpu_limit:g}")
    if cp.slices is not None:  # canary releases: the version registry and the controller
        services.versions = VersionRegistry(cp.store)
        services.canary = running.canary = CanaryController(cp.fleet, services.versions, cp.slices)
        running.canary.recover()
    schedules = services.schedules = drill_scheduler(cfg.drills, cp.store, drills,
                                                     loop=asyncio.get_running_loop())
    await asyncio.to_thread(schedules.start)  # before the API answers, so it lists the stored schedules
    running.schedules = schedules
    cp.servers = [_Server(uvicorn.Config(create_api(services), log_level="warning", lifespan="off"))]
    running.tasks += [asyncio.create_task(cp.servers[0].serve(sockets=[api_socket]), name="api"),
                      asyncio.create_task(_refresh_loads(cp), name="loads"),
                      asyncio.create_task(Retention(cp.store, cfg.retention).run(), name="retention")]
    await _api_listening(cp.servers[0], running.tasks[0])
    # The gateways watch the API: started (or adopted) once it answers, so they get the replica set at once.
    running.gateways = True
    cp.gateways.adopt_or_start()
    cp.gateways.start()
    await cp.gateways.wait_ready(GATEWAY_READY_TIMEOUT_S)
    cp.console = start_console(cfg, cp.store, api_url(cfg))
    # What start-up built lives as long as the process; out of the collector's reach, a full collection
    # scans only what requests allocate and does not stall the API or the loops for tens of ms.
    gc.freeze()
    _announce(cp)
    if cfg.alerts.enabled:
        running.tasks.append(asyncio.create_task(alerts.run(), name="alerts"))
    if cfg.autoscaler.enabled:
        running.autoscaler.start()


async def _stop(cp: ControlPlane, running: _Running) -> None:
    """Stop what ``_start`` started, in the order that loses nothing: first what acts on the fleet, then
    the faults, then the data plane (gateways drain their streams, then replicas theirs), then the rest."""
    if running.alerts is not None:
        running.alerts.stop()  # no alert action (a replica restart) while the fleet drains
    if running.schedules is not None:  # no scheduled drill while the fleet drains
        await asyncio.to_thread(running.schedules.shutdown, cp.config.drills.schedule_shutdown_timeout_s)
    if running.autoscaler is not None:
        await running.autoscaler.stop()  # no scaling while the fleet drains
    if running.canary is not None:
        await running.canary.stop()  # a release running now aborts
    logger.warning("stopping: draining replicas")
    await asyncio.to_thread(stop_console, cp.console)
    cp.feed.close()  # the gateways' long polls answer now: the API's graceful shutdown waits on none
    for server in cp.servers:
        server.should_exit = True
    if running.drills is not None:
        await running.drills.aclose()  # a running drill aborts: its load stops and its faults are reverted
    if running.experiments is not None:
        await running.experiments.aclose()  # a slice experiment aborts: fault reverted, colours cleared
    if running.chaos is not None:
        await running.chaos.halt_all()  # nothing injected outlives the control plane
        await running.chaos.aclose()
    if running.gateways:
        await cp.gateways.stop()  # each drains its streams, then the replicas drain theirs
    if running.fleet:
        await cp.fleet.stop(drain=True)
    if running.telemetry:
        cp.telemetry.stop()
    if running.prometheus and cp.prometheus is not None:
        cp.prometheus.stop()
    for task in running.tasks:
        task.cancel()
    await asyncio.gather(*running.tasks, return_exceptions=True)
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


async def _api_listening(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    """Until the API server listens; ``OSError`` when it could not (its address is taken)."""
    while not server.started:
        if task.done():
            raise OSError(f"the API server did not start: {task.exception() or 'it exited'}")
        await asyncio.sleep(0.02)


async def _refresh_loads(cp: ControlPlane) -> None:
    while True:
        await asyncio.to_thread(cp.loads.refresh)
        await asyncio.sleep(cp.config.telemetry.scrape_interval_s)


def _announce(cp: ControlPlane) -> None:
    cfg = cp.config
    lines = [
        f"gateway (OpenAI API): http://{cfg.gateway.host}:{cfg.gateway.port}/v1  "
        f"({cfg.gateway.processes} process{'es' if cfg.gateway.processes > 1 else ''}, admin "
        f"{', '.join(cp.gateways.admin_addresses)})",
        f"control plane API:    http://{cfg.api.host}:{cfg.api.port}  (OpenAPI: /docs)",
        f"prometheus:           {cp.prometheus.url if cp.prometheus else 'not running (in-process scraper)'}",
        f"state:                {cfg.state_path}",
        f"replicas:             {cfg.fleet.replicas} of model {cfg.fleet.model} "
        f"in {', '.join(cfg.fleet.zones)}"
        + (f" on the Ray cluster at {cfg.fleet.ray_address}" if cfg.fleet.backend == "ray" else ""),
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
