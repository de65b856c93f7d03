"""``python -m controlplane.gateway``: the gateway as a process of its own, which outlives the control plane.

Where it sits: ``controlplane up`` starts one or more of these (each in its own session, like the
replicas) and supervises them; a control plane restarted after a crash adopts the ones that run. Each one

- serves clients on the data address (``--host``/``--port``), bound with ``SO_REUSEPORT`` so that several
  gateways share it and the kernel spreads connections over them;
- serves its admin app (:mod:`controlplane.gateway.admin`: metrics, state, toxics, admission) on an
  address of its own (``--admin-port``);
- learns the replica set from the control plane (:mod:`controlplane.gateway.discovery`) and keeps it on
  disk in ``--state-dir``, so that it goes on serving, probing, ejecting and resuming when the control
  plane is down, and starts serving from the file when it is started while the control plane is down;
- buffers its traces and events for the control plane (:mod:`controlplane.gateway.reports`).

Its settings come as the ``[gateway]`` table in JSON (``--config``, written by the control plane with
mode 0600: it holds the client API keys). Tokens come in the environment, never on the command line:
``GATEWAY_TOKEN`` (what it shows the control plane) and ``GATEWAY_ADMIN_TOKEN`` (what the control plane
must show it). SIGTERM or SIGINT stops accepting, lets the streams in flight finish (up to
``--drain-timeout``), delivers what it buffered and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn
import uvloop

from controlplane.gateway.admin import create_admin_app
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.discovery import Discovery
from controlplane.gateway.handler import Gateway
from controlplane.gateway.reports import Reports
from controlplane.gateway.server import create_gateway_app
from controlplane.replicas import ReplicaEndpoint
from controlplane.traces import TraceSampler

logger = logging.getLogger(__name__)

TOKEN_ENV = "GATEWAY_TOKEN"
ADMIN_TOKEN_ENV = "GATEWAY_ADMIN_TOKEN"
DEFAULT_DRAIN_TIMEOUT_S = 10.0
FIRST_POLL_WAIT_S = 0.0  # at start: take what the control plane has now, do not wait for a change
EXIT_BIND_FAILED = 3


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this process serves two apps and stops them together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listening_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A bound, listening TCP socket; with ``reuse_port`` other gateways may bind the same address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP said, not left 0: asyncio sets TCP_NODELAY on an accepted connection only when its
    # socket's proto is TCP; without it Nagle held each small write for the client's delayed ACK (40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(False)
    return sock


def read_config(path: Path | None) -> GatewayConfig:
    """The ``[gateway]`` table as JSON; unknown keys are refused (``ValueError``)."""
    if path is None:
        return GatewayConfig()
    raw = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    known = {f.name for f in dataclasses.fields(GatewayConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}")
    return GatewayConfig(**raw)


def write_config(path: Path, config: GatewayConfig) -> None:
    """What :func:`read_config` reads, readable by the owner only (it holds the client API keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(config), f, indent=1)
    tmp.replace(path)


@dataclasses.dataclass(slots=True)
class GatewayProcess:
    """The parts of one gateway process, built by :func:`build` and run by :func:`serve`."""

    name: str
    config: GatewayConfig
    gateway: Gateway
    discovery: Discovery
    reports: Reports
    admin_token: str

    def status(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "discovery": self.discovery.status(), "reports": self.reports.status()}


def build(args: argparse.Namespace, *, environ: dict[str, str] | None = None) -> GatewayProcess:
    env = os.environ if environ is None else environ
    config = read_config(args.config)
    config.host, config.port = args.host, args.port
    token = env.get(TOKEN_ENV) or None
    static = [ReplicaEndpoint.from_json(e) for e in json.loads(args.endpoints.read_text())] \
        if args.endpoints else []
    discovery = Discovery(control_plane=args.control_plane, token=token, state_dir=args.state_dir,
                          static=static)
    reports = Reports(gateway=args.name, control_plane=args.control_plane, token=token,
                      sampler=TraceSampler(config.trace_sample_rate))
    gateway = Gateway(config, endpoints=discovery.endpoints, load=discovery.load, on_trace=reports.trace,
                      on_event=reports.event, slices=discovery.slices)
    return GatewayProcess(args.name, config, gateway, discovery, reports, env.get(ADMIN_TOKEN_ENV) or "")


async def serve(gp: GatewayProcess, data_sock: socket.socket, admin_sock: socket.socket | None, *,
                drain_timeout_s: float) -> None:
    """Serve until SIGTERM/SIGINT; then drain the streams in flight and deliver what is buffered."""
    await _first_replica_set(gp.discovery)
    gp.discovery.start()
    gp.reports.start()
    data = create_gateway_app(gp.gateway)
    servers = [(_Server(uvicorn.Config(data, log_level="warning", access_log=False, lifespan="on",
                                       timeout_graceful_shutdown=int(max(drain_timeout_s, 1)))), data_sock)]
    if admin_sock is not None:
        admin = create_admin_app(gp.gateway, name=gp.name, admin_token=gp.admin_token, status=gp.status)
        servers.append((_Server(uvicorn.Config(admin, log_level="warning", access_log=False,
                                               lifespan="off")), admin_sock))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(server.serve(sockets=[sock])) for server, sock in servers]
    gc.freeze()  # start-up objects live as long as the process: full collections skip them
    logger.warning("[%s] serving on %s:%d (admin %s), replica set from %s", gp.name, gp.config.host,
                   gp.config.port, _address(admin_sock), gp.discovery.source)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)  # a signal, or a server ended
    stopped.cancel()
    logger.warning("[%s] stopping: draining %d streams", gp.name, sum(gp.gateway.inflight().values()))
    for server, _ in servers:
        server.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    await gp.discovery.stop()
    await gp.reports.stop(flush=True)


async def _first_replica_set(discovery: Discovery) -> None:
    """From the control plane when it answers now, else from the file an earlier run left."""
    if discovery.control_plane is not None and await discovery.poll_once(FIRST_POLL_WAIT_S):
        return
    discovery.load_state()


def _address(sock: socket.socket | None) -> str:
    if sock is None:
        return "off"
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m controlplane.gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="gw-0", help="this gateway's name (events, metrics, adoption)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the data address clients call (shared)")
    p.add_argument("--admin-port", type=int, default=None, help="this gateway's own admin address "
                   "(metrics, state, toxics); none: no admin listener")
    p.add_argument("--control-plane", default=None, help="the control plane's API, e.g. http://127.0.0.1:8080")
    p.add_argument("--state-dir", type=Path, default=None, help="where the last known replica set is kept")
    p.add_argument("--config", type=Path, default=None, help="the [gateway] settings as JSON")
    p.add_argument("--endpoints", type=Path, default=None,
                   help="a JSON list of replica endpoints to route over without a control plane")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S)
    p.add_argument("--no-reuse-port", action="store_true", help="bind the data address exclusively")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per long poll and per delivery
    try:
        gp = build(args)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"gateway: bad settings: {exc}", file=sys.stderr)
        return 2
    try:
        data_sock = listening_socket(args.host, args.port, reuse_port=not args.no_reuse_port)
        admin_sock = None if args.admin_port is None else \
            listening_socket(args.host, args.admin_port, reuse_port=False)
    except OSError as exc:
        print(f"gateway: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BIND_FAILED
    # uvloop, the loop uvicorn.run gives the replicas: on the stdlib loop the gateway spent about twice the
    # CPU per relayed request (5.6 against 2.8 ms at one stream in the gateway benchmark).
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(gp, data_sock, admin_sock, drain_timeout_s=args.drain_timeout))
    return 0
