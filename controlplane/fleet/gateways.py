"""The gateway processes: started, watched, restarted and adopted by the control plane, never needed by it.

Where it sits: beside the fleet's replicas, the other half of the data plane. ``controlplane up`` runs
``gateway.processes`` gateways (``python -m controlplane.gateway``, :mod:`controlplane.gateway.process`),
each in its own session so that neither a terminal's Ctrl-C nor the control plane's death reaches it. They
share the data address (``SO_REUSEPORT``) and each has an admin address of its own. Their pids and admin
ports are kept in the store, so a control plane restarted after ``kill -9`` adopts the gateways that run
(checking that each pid's command line names that gateway) and starts the missing ones.

The supervisor also speaks for the gateways to the rest of the control plane: their streams in flight
per replica (for drills), link toxics applied on every gateway (:class:`GatewayLinks`, the chaos layer's
``LinkControl``), their state for the API, and the requests they refused for want of capacity
(:mod:`controlplane.fleet.refusals`, for the autoscaler). A gateway that dies is restarted with backoff;
the toxics in place are applied to it again once it answers.

Tokens: each gateway gets two, derived from the control plane's secret (so they survive restarts without
being stored): one it shows the control plane (endpoints watch, reports) and one the control plane shows
its admin API. Both reach it in the environment, never on a command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import psutil

from controlplane.fleet.refusals import RefusalCounts
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.process import (
    ADMIN_TOKEN_ENV,
    EXIT_BIND_FAILED,
    TOKEN_ENV,
    read_config,
    write_config,
)
from controlplane.gateway.slices import Outcome
from inference.environment import child_environment

logger = logging.getLogger(__name__)

REGISTRY_KEY = "gateways.registry"  # name -> {"pid", "admin_port"}
ADMISSION_KEY = "gateways.admission"  # admission limits set at run time, over the [gateway] config's
ADMISSION_FIELDS = ("rate_limit_rps", "rate_limit_tokens_per_s", "max_inflight_per_replica")
WATCH_INTERVAL_S = 0.5
STATE_TIMEOUT_S = 2.0
RESTART_BACKOFF_S, RESTART_BACKOFF_MAX_S = 0.5, 30.0
STOP_GRACE_S = 5.0  # beyond the drain timeout, before SIGKILL


class GatewayStore(Protocol):
    def kv_put(self, key: str, value: Any) -> None: ...

    def kv_get(self, key: str, default: Any = None) -> Any: ...

    def add_event(self, kind: str, subject: str, detail: dict[str, Any]) -> Any: ...


def gateway_token(secret: bytes, name: str, purpose: str) -> str:
    """``purpose`` "service" (gateway -> control plane) or "admin" (control plane -> gateway)."""
    return hmac.new(secret, f"gateway-{purpose}:{name}".encode(), hashlib.sha256).hexdigest()


@dataclass(slots=True)
class ManagedGateway:
    name: str
    admin_port: int
    pid: int | None = None
    process: subprocess.Popen[bytes] | None = None  # None when adopted (not our child)
    state: str = "starting"  # starting | ready | crashed | stopped
    restarts: int = 0
    restart_at: float | None = None
    started_at: float = 0.0
    exit_status: int | None = None  # of its last process, once it exited
    last_state: dict[str, Any] = field(default_factory=dict)  # its /admin/state, the latest answer

    def to_json(self) -> dict[str, Any]:
        discovery = self.last_state.get("discovery", {})
        seen = self.last_state
        return {"name": self.name, "pid": self.pid, "state": self.state, "admin_port": self.admin_port,
                "restarts": self.restarts, "routable": seen.get("routable", []),
                "ejected": seen.get("ejected", []), "inflight": seen.get("inflight", {}),
                "replica_set": {k: discovery.get(k) for k in ("source", "version", "replicas")},
                "reports": self.last_state.get("reports", {}), "refused": seen.get("refused", {})}


class GatewaySupervisor:
    def __init__(self, config: GatewayConfig, *, api_url: str, state_dir: Path, store: GatewayStore,
                 secret: bytes, reserved_ports: frozenset[int] = frozenset(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.api_url, self.state_dir, self.store = config, api_url, state_dir, store
        self.secret, self.clock = secret, clock
        self.log_dir = state_dir / "logs"
        self.links = GatewayLinks(self)
        self.refusals = RefusalCounts(clock=clock)  # for the autoscaler: load the replicas never saw
        registry = dict(store.kv_get(REGISTRY_KEY, {}) or {})
        wanted = {f"gw-{i}" for i in range(config.processes)}
        self._retired = {name: entry.get("pid") for name, entry in registry.items()
                         if isinstance(entry, dict) and name not in wanted}
        taken = set(reserved_ports)
        self.gateways: dict[str, ManagedGateway] = {}
        for i in range(config.processes):
            name = f"gw-{i}"
            port = int(registry.get(name, {}).get("admin_port") or 0) or _admin_port(config, i, taken)
            taken.add(port)
            self.gateways[name] = ManagedGateway(name, port, pid=registry.get(name, {}).get("pid"))
        self._client = httpx.AsyncClient(trust_env=False, timeout=STATE_TIMEOUT_S)
        self._task: asyncio.Task[None] | None = None

    # ---- what others read ----
    @property
    def admin_addresses(self) -> list[str]:
        return [f"{self.config.host}:{g.admin_port}" for g in self.gateways.values()]

    def service_tokens(self) -> dict[str, str]:
        return {name: gateway_token(self.secret, name, "service") for name in self.gateways}

    def inflight(self) -> dict[str, int]:
        """Streams in flight per replica, over every gateway (their latest answers)."""
        total: dict[str, int] = {}
        for g in self.gateways.values():
            for rid, n in (g.last_state.get("inflight") or {}).items():
                total[rid] = total.get(rid, 0) + int(n)
        return total

    def status(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self.gateways.values()]

    def num_ready(self) -> int:
        return sum(1 for g in self.gateways.values() if g.state == "ready")

    async def set_admission(self, changes: Mapping[str, float | int]) -> dict[str, Any]:
        """Change admission limits on every gateway now, and on every gateway that starts later (kept in
        the store across restarts of the control plane); ``ValueError`` for an unknown field."""
        unknown = sorted(set(changes) - set(ADMISSION_FIELDS))
        if unknown:
            raise ValueError(f"{unknown[0]}: not an admission limit (known: {', '.join(ADMISSION_FIELDS)})")
        admission = {**self.admission(), **changes}
        self.store.kv_put(ADMISSION_KEY, admission)
        applied = await asyncio.gather(*(self._put_admission(g) for g in self.gateways.values()))
        return {"admission": admission, "applied": [g for g, ok in zip(self.gateways, applied) if ok]}

    def admission(self) -> dict[str, float | int]:
        return dict(self.store.kv_get(ADMISSION_KEY, {}) or {})

    def max_inflight_per_replica(self) -> int:
        """The most requests the gateways let one replica hold now (set at run time, else configured):
        the largest batch a replica can run, whatever its engine allows (for the autoscaler)."""
        return int(self.admission().get("max_inflight_per_replica", self.config.max_inflight_per_replica))

    async def _put_admission(self, g: ManagedGateway) -> bool:
        admission = self.admission()
        if not admission or g.state != "ready":
            return False
        url = f"http://{self.config.host}:{g.admin_port}/admin/admission"
        try:
            response = await self._client.put(url, json=admission, headers=self.admin_headers(g.name))
            response.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("[%s] admission limits not applied: %s", g.name, exc)
            return False
        return True

    async def slice_outcomes(self, since: float) -> dict[str, dict[str, list[Outcome]]]:
        """Each ready gateway's per-slice outcomes since ``since`` (wall clock); a gateway that does not
        answer is left out (logged)."""
        async def ask(g: ManagedGateway) -> tuple[str, dict[str, list[Outcome]] | None]:
            url = f"http://{self.config.host}:{g.admin_port}/admin/slices"
            try:
                response = await self._client.get(url, params={"since": since},
                                                  headers=self.admin_headers(g.name))
                response.raise_for_status()
                raw = response.json()["outcomes"]
                return g.name, {name: [Outcome.from_json(o) for o in rows] for name, rows in raw.items()}
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                logger.warning("[%s] slice outcomes not read: %s", g.name, exc)
                return g.name, None
        answers = await asyncio.gather(*(ask(g) for g in self.gateways.values() if g.state == "ready"))
        return {name: outcomes for name, outcomes in answers if outcomes is not None}

    def kill_one(self) -> str:
        """``kill -9`` the gateway with the most streams in flight (the gateway-crash drill); its name.
        The watch notices the exit and restarts it, as it would after a real crash."""
        alive = [g for g in self.gateways.values() if _alive(g)]
        if not alive:
            raise OSError("no gateway process is running")
        victim = max(alive, key=lambda g: (sum((g.last_state.get("inflight") or {}).values()), g.name))
        logger.warning("[%s] killed on purpose (gateway-crash drill), pid %s", victim.name, victim.pid)
        _signal(victim, signal.SIGKILL, self.state_dir)
        return victim.name

    # ---- lifecycle ----
    def adopt_or_start(self) -> None:
        """Adopt the gateways an earlier control plane left running; start the others; stop the ones a
        smaller ``gateway.processes`` no longer asks for (they drain)."""
        for g in self.gateways.values():
            if g.pid is not None and _is_our_gateway(g.pid, g.name, self.state_dir):
                g.state, g.started_at = "starting", self.clock()
                logger.warning("[%s] adopted the running gateway (pid %d)", g.name, g.pid)
                self.store.add_event("gateway.adopted", g.name, {"pid": g.pid})
                self._check_config(g)
                continue
            self._spawn(g)
        for name, pid in self._retired.items():
            if isinstance(pid, int) and _is_our_gateway(pid, name, self.state_dir):
                logger.warning("[%s] no longer asked for (gateway.processes = %d): draining pid %d", name,
                               self.config.processes, pid)
                self.store.add_event("gateway.retired", name, {"pid": pid})
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        self._save()

    def _check_config(self, g: ManagedGateway) -> None:
        """An adopted gateway runs with the settings it was started with: say so when they differ."""
        path = self.state_dir / "gateways" / g.name / "config.json"
        try:
            running = read_config(path)
        except (OSError, ValueError, TypeError):
            return
        if running != self.config:
            changed = sorted(f.name for f in dataclasses.fields(self.config)
                             if getattr(running, f.name) != getattr(self.config, f.name))
            logger.warning("[%s] runs with an older [gateway] config (%s differ); it applies once the "
                           "gateway restarts", g.name, ", ".join(changed))
            self.store.add_event("gateway.config_drift", g.name, {"keys": changed})

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="gateway-supervisor")

    async def wait_ready(self, timeout_s: float) -> None:
        """Until every gateway answers its admin API; ``OSError`` when one cannot listen or none is ready
        in time."""
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            await self.check_once()
            failed = [g for g in self.gateways.values() if g.exit_status == EXIT_BIND_FAILED]
            if failed:
                raise OSError(f"gateway {failed[0].name} cannot listen on {self.config.host}:"
                              f"{self.config.port} or its admin port {failed[0].admin_port} (see "
                              f"{self.log_dir / (failed[0].name + '.log')})")
            if all(g.state == "ready" for g in self.gateways.values()):
                return
            await asyncio.sleep(0.1)
        waiting = [g.name for g in self.gateways.values() if g.state != "ready"]
        raise OSError(f"gateways {', '.join(waiting)} not ready after {timeout_s:g}s")

    async def stop(self) -> None:
        """Drain and stop every gateway (Ctrl-C of ``controlplane up``): SIGTERM, then SIGKILL."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for g in self.gateways.values():
            _signal(g, signal.SIGTERM, self.state_dir)
        deadline = self.clock() + self.config.drain_timeout_s + STOP_GRACE_S
        while any(_alive(g) for g in self.gateways.values()) and self.clock() < deadline:
            await asyncio.sleep(0.1)
        for g in self.gateways.values():
            if _alive(g):
                logger.error("[%s] did not stop after SIGTERM: killed", g.name)
                _signal(g, signal.SIGKILL, self.state_dir)
            if g.process is not None:
                await asyncio.to_thread(g.process.wait)
            g.state, g.pid, g.process = "stopped", None, None
        self._save()
        await self._client.aclose()

    # ---- the watch ----
    async def _watch(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # the watch must not die; the next round tries again
                logger.exception("gateway supervision round failed")
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def refresh_state(self) -> None:
        """Ask every running gateway for its state now (a drill aiming at streams in flight cannot wait
        for the next round of the watch)."""
        await asyncio.gather(*(self._ask_state(g) for g in self.gateways.values()
                               if g.state == "ready" and _alive(g)))

    async def check_once(self) -> None:
        for g in self.gateways.values():
            if g.state == "crashed":
                if g.restart_at is not None and self.clock() >= g.restart_at:
                    self._spawn(g)
                    self._save()
                continue
            if not _alive(g):
                self._crashed(g)
                continue
            await self._ask_state(g)

    async def _ask_state(self, g: ManagedGateway) -> None:
        try:
            response = await self._client.get(f"http://{self.config.host}:{g.admin_port}/admin/state",
                                              headers=self.admin_headers(g.name))
            response.raise_for_status()
            g.last_state = response.json()
        except (httpx.HTTPError, ValueError):
            return  # starting, or busy: the liveness check above decides about a crash
        refused = g.last_state.get("refused")
        if isinstance(refused, dict):
            self.refusals.observe(g.name, refused)
        if g.state != "ready":
            g.state = "ready"
            logger.info("[%s] ready (pid %s)", g.name, g.pid)
            self.store.add_event("gateway.ready", g.name, {"pid": g.pid})
            await self.links.reapply(g)
            await self._put_admission(g)  # limits set at run time outlive the gateways they were set on

    def admin_headers(self, name: str) -> dict[str, str]:
        return {"authorization": f"Bearer {gateway_token(self.secret, name, 'admin')}"}

    def _crashed(self, g: ManagedGateway) -> None:
        status = g.exit_status = g.process.poll() if g.process is not None else None
        delay = min(RESTART_BACKOFF_S * 2 ** min(g.restarts, 10), RESTART_BACKOFF_MAX_S)
        g.state, g.restart_at, g.last_state = "crashed", self.clock() + delay, {}
        logger.warning("[%s] gateway pid %s exited (status %s); restarting in %.1fs", g.name, g.pid, status,
                       delay)
        self.store.add_event("gateway.crashed", g.name, {"pid": g.pid, "exit_status": status,
                                                         "restart_in_s": delay})
        g.pid, g.process = None, None

    def _spawn(self, g: ManagedGateway) -> None:
        home = self.state_dir / "gateways" / g.name
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_config(home / "config.json", self.config)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = child_environment({TOKEN_ENV: gateway_token(self.secret, g.name, "service"),
                                 ADMIN_TOKEN_ENV: gateway_token(self.secret, g.name, "admin")})
        with open(self.log_dir / f"{g.name}.log", "ab") as log:
            g.process = subprocess.Popen(self.command(g), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        if g.state == "crashed":
            g.restarts += 1
        g.pid, g.state, g.restart_at, g.started_at = g.process.pid, "starting", None, self.clock()
        logger.info("[%s] started gateway pid %d on %s:%d (admin port %d)", g.name, g.pid, self.config.host,
                    self.config.port, g.admin_port)

    def command(self, g: ManagedGateway) -> list[str]:
        home = self.state_dir / "gateways" / g.name
        return [sys.executable, "-m", "controlplane.gateway", "--name", g.name, "--host", self.config.host,
                "--port", str(self.config.port), "--admin-port", str(g.admin_port),
                "--control-plane", self.api_url, "--state-dir", str(home),
                "--config", str(home / "config.json"),
                "--drain-timeout", f"{self.config.drain_timeout_s:g}"]

    def _save(self) -> None:
        self.store.kv_put(REGISTRY_KEY, {g.name: {"pid": g.pid, "admin_port": g.admin_port}
                                         for g in self.gateways.values()})


class GatewayLinks:
    """Link toxics on every gateway: the chaos layer's ``LinkControl`` for the link faults.

    The control plane names each toxic, so all gateways hold it under one id, a retry is harmless and a
    gateway that (re)starts gets the toxics still in place. A toxic carries its remaining lifetime, so it
    ends on time in the gateways even when the control plane is down by then."""

    def __init__(self, supervisor: GatewaySupervisor) -> None:
        self.supervisor = supervisor
        self.active: dict[str, tuple[str, dict[str, Any], float | None]] = {}  # id -> replica, toxic, ends
        self._ids = 0

    async def add(self, replica_id: str, toxic: Mapping[str, Any], *, duration_s: float | None = None) -> str:
        self._ids += 1
        toxic_id = f"toxic-{os.getpid()}-{self._ids}"
        ends = None if duration_s is None else self.supervisor.clock() + duration_s
        self.active[toxic_id] = (replica_id, dict(toxic), ends)
        results = await asyncio.gather(*(self._put(g, toxic_id) for g in self.supervisor.gateways.values()))
        if not any(results):
            self.active.pop(toxic_id, None)
            raise OSError("no gateway took the toxic (none is answering)")
        return toxic_id

    async def remove(self, toxic_id: str) -> bool:
        self.active.pop(toxic_id, None)
        sv = self.supervisor
        results = await asyncio.gather(*(self._delete(g, toxic_id) for g in sv.gateways.values()))
        return any(results)

    async def reapply(self, g: ManagedGateway) -> None:
        for toxic_id in list(self.active):
            await self._put(g, toxic_id)

    async def _put(self, g: ManagedGateway, toxic_id: str) -> bool:
        entry = self.active.get(toxic_id)
        if entry is None:
            return False
        replica_id, toxic, ends = entry
        left = None if ends is None else ends - self.supervisor.clock()
        if left is not None and left <= 0:
            self.active.pop(toxic_id, None)
            return False
        body = {"replica_id": replica_id, **toxic, "duration_s": left}
        return await self._call(g, "PUT", toxic_id, body)

    async def _delete(self, g: ManagedGateway, toxic_id: str) -> bool:
        return await self._call(g, "DELETE", toxic_id, None)

    async def _call(self, g: ManagedGateway, method: str, toxic_id: str, body: dict[str, Any] | None) -> bool:
        sv = self.supervisor
        url = f"http://{sv.config.host}:{g.admin_port}/admin/toxics/{toxic_id}"
        try:
            response = await sv._client.request(method, url, json=body, headers=sv.admin_headers(g.name))
        except httpx.HTTPError as exc:
            logger.warning("[%s] toxic %s: %s %s failed: %s", g.name, toxic_id, method, url, exc)
            return False
        if response.status_code >= 400:
            raise ValueError(f"gateway {g.name} refused the toxic: {response.text[:200]}")
        return True


def _admin_port(config: GatewayConfig, index: int, taken: set[int]) -> int:
    if config.admin_port:
        return config.admin_port + index
    port = _free_port(config.host)
    while port in taken:
        port = _free_port(config.host)
    return port


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _alive(g: ManagedGateway) -> bool:
    if g.process is not None:
        return g.process.poll() is None
    if g.pid is None:
        return False
    try:
        return bool(psutil.Process(g.pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _is_our_gateway(pid: int, name: str, state_dir: Path) -> bool:
    """``pid`` runs gateway ``name`` of this state folder (another control plane's gateway of the same name,
    or whatever took the pid over since, is not ours)."""
    try:
        args = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    home = (state_dir / "gateways" / name).resolve()
    return ("controlplane.gateway" in args and "--name" in args and args[args.index("--name") + 1] == name
            and "--state-dir" in args and Path(args[args.index("--state-dir") + 1]).resolve() == home)


def _signal(g: ManagedGateway, sig: signal.Signals, state_dir: Path) -> None:
    """Signal the gateway, never whatever runs under its pid now (pids are reused): our child only while it
    is unreaped, an adopted one only while its pid still runs this gateway."""
    if g.process is not None:
        if g.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                g.process.send_signal(sig)
        return
    if g.pid is not None and _is_our_gateway(g.pid, g.name, state_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(g.pid, sig)
