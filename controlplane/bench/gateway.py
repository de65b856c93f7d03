"""``python -m controlplane.bench gateway``: the latency the gateway adds to a stream, against the replica.

Beside the request path, not in it: one real replica (``python -m inference serve``) and one gateway in
its own process as ``controlplane up`` runs it (``python -m controlplane.gateway``, here on a static replica
set), both on loopback. A closed loop of C workers sends streaming ``/v1/completions`` requests, in rounds
that alternate between the replica itself and the gateway (ABBA order, so drift and machine noise fall on
both routes alike; the load is :mod:`controlplane.bench.load`). Per request it records the client's TTFT
(send -> first chunk with a choice, i.e. the first token) and E2E (send -> ``[DONE]``) with the replica's
own queue and prefill times from the ``timings`` of its last chunk.

The gateway's added latency is estimated two ways: the difference of the routes' TTFT percentiles, and
per request as client TTFT - replica (queue + prefill), gateway minus direct, which takes out the
engine's share of each TTFT. Each added TTFT percentile comes with a 95% interval from resampling whole
rounds (:mod:`controlplane.bench.stats`). ``--gateway-in-thread`` serves it from a thread of the client's
process instead, sharing one GIL with the load client (the switch interval alone is 5 ms): a comparison,
not the product.

``--control-plane idle,busy`` (the default) runs every level twice: with nothing else on the gateway's CPUs,
and with a control plane at its busiest there (:mod:`controlplane.bench.busy`: what-if simulations back to
back at the control plane's batch priority, and a drill report every second).

Where the processes run is :mod:`controlplane.bench.layout`; the results and the report are
:mod:`controlplane.bench.report`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from controlplane.bench.layout import SHARED, CpuLayout, GatewayMode, LayoutKind, cpu_list, load_thread
from controlplane.bench.load import MODEL, Route, run_load
from controlplane.bench.report import (
    GatewayBenchResult,
    LevelResult,
    MachineNote,
    format_report,
    sample_lines,
    worst,
)
from controlplane.config import STATE_DIR_ENV
from controlplane.errors import ControlPlaneError
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.handler import Gateway
from controlplane.gateway.process import write_config
from controlplane.gateway.server import create_gateway_app
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from inference.environment import child_environment
from inference.launcher import ReplicaProcess, free_port

logger = logging.getLogger(__name__)

ControlPlaneLoad = Literal["idle", "busy"]
DEFAULT_LEVELS = (1, 16, 64)
DEFAULT_REQUESTS = (1600, 8192, 16384)  # per level, both routes together, warm-up not included: 16 rounds
# or more per route at every level (an interval needs stats.MIN_ROUNDS)
DEFAULT_ROUND_SIZE = 50  # requests per round on one route (at least 4 C; the first C are not counted)
DEFAULT_MAX_TOKENS = 16
REPLICA_ID = "bench-gw-0"
REPLICA_THREADS = 2
REPLICA_MAX_NUM_SEQS = 128
REPLICA_MAX_WAITING = 100_000
REPLICA_READY_TIMEOUT_S = 120.0
GATEWAY_READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
LEVEL_TIMEOUT_S = 600.0  # one concurrency level, warm-up included
# The gateway must not shed, retry or resume during the benchmark: each would measure something else.
GATEWAY_MAX_INFLIGHT = 4096
GATEWAY_STALL_TIMEOUT_S = 60.0
GATEWAY_FIRST_BYTE_TIMEOUT_S = 60.0


# Exit status of ``python -m controlplane.bench gateway``: a target missed and a target not resolved (the
# interval straddles it) both fail the run, with different codes; 2 is a benchmark that could not run.
EXIT_CODES = {"pass": 0, "fail": 1, "not resolved": 3}


class BenchError(ControlPlaneError, RuntimeError):
    """The benchmark could not run to the end (a process did not start, a level ran out of time)."""


# ---- the processes -------------------------------------------------------------------------
def bench_gateway_config(port: int) -> GatewayConfig:
    # No probes of an idle replica: while the direct route runs, the gateway sees its replica idle and
    # would put a forward pass a second into the baseline's measurements only.
    return GatewayConfig(port=port, max_inflight_per_replica=GATEWAY_MAX_INFLIGHT,
                         stall_timeout_s=GATEWAY_STALL_TIMEOUT_S,
                         first_byte_timeout_s=GATEWAY_FIRST_BYTE_TIMEOUT_S, probe_idle_replicas=False)


def _gateway_app(port: int, endpoint: ReplicaEndpoint) -> Any:
    gateway = Gateway(bench_gateway_config(port), endpoints=lambda: [endpoint])
    return create_gateway_app(gateway)


def _uvicorn_config(port: int, endpoint: ReplicaEndpoint) -> uvicorn.Config:
    return uvicorn.Config(_gateway_app(port, endpoint), host="127.0.0.1", port=port, log_level="warning",
                          access_log=False, lifespan="on")


class GatewayProcess:
    """The gateway as ``controlplane up`` runs it: ``python -m controlplane.gateway``, its own process, here
    on a static replica set (``--endpoints``) instead of the control plane's watch."""

    def __init__(self, port: int, endpoint: ReplicaEndpoint, cpus: tuple[int, ...] = (), *,
                 workdir: Path) -> None:
        self.port, self.endpoint, self.cpus, self.workdir = port, endpoint, cpus, workdir
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        config, endpoints = self.workdir / "gateway.json", self.workdir / "endpoints.json"
        write_config(config, bench_gateway_config(self.port))
        endpoints.write_text(json.dumps([self.endpoint.to_json()]))
        command = [sys.executable, "-m", "controlplane.gateway", "--name", "bench-gw",
                   "--port", str(self.port), "--config", str(config), "--endpoints", str(endpoints),
                   "--drain-timeout", "1"]
        with open(self.workdir / "gateway.log", "ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=child_environment())
        if self.cpus:
            os.sched_setaffinity(self._process.pid, self.cpus)

    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the gateway process so far; None where unknown."""
        try:
            times = psutil.Process(self._process.pid if self._process else -1).cpu_times()
        except (psutil.Error, ValueError):
            return None
        return float(times.user + times.system)

    def stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.terminate()  # SIGTERM: the gateway drains (nothing is in flight by now) and exits
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)


class BusyControlPlane:
    """``python -m controlplane.bench.busy`` on the gateway's CPUs while the levels run (``--control-plane
    busy``): what-if simulations at the control plane's batch priority and drill reports at normal."""

    def __init__(self, cpus: tuple[int, ...], log: Path) -> None:
        self.cpus, self.log = cpus, log
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> BusyControlPlane:
        with open(self.log, "ab") as out:
            self._process = subprocess.Popen([sys.executable, "-m", "controlplane.bench.busy"], stdout=out,
                                             stderr=subprocess.STDOUT, env=child_environment())
        if self.cpus:
            os.sched_setaffinity(self._process.pid, self.cpus)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(STOP_TIMEOUT_S)

    def summary(self) -> str:
        try:
            return self.log.read_text().strip().splitlines()[-1]
        except (OSError, IndexError):
            return "busy control plane: no summary"


class GatewayThread:
    """The gateway served by uvicorn on a thread of this process (shares the load client's GIL)."""

    def __init__(self, port: int, endpoint: ReplicaEndpoint) -> None:
        self.port, self.endpoint = port, endpoint
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._server = uvicorn.Server(_uvicorn_config(self.port, self.endpoint))
        self._thread = threading.Thread(target=self._server.run, name="bench-gateway", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def cpu_seconds(self) -> float | None:
        return None  # one process with the load client: its CPU time is not the gateway's alone

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(STOP_TIMEOUT_S)


def wait_gateway_ready(server: GatewayProcess | GatewayThread, url: str) -> None:
    deadline = time.monotonic() + GATEWAY_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not server.is_alive():
            raise BenchError(f"the gateway on {url} exited before it answered /health")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        time.sleep(0.1)
    raise BenchError(f"the gateway on {url} did not answer /health within {GATEWAY_READY_TIMEOUT_S:g}s")


def start_replica(state_dir: Path, log_path: Path, threads: int,
                  cpus: tuple[int, ...] = ()) -> ReplicaProcess:
    from inference.models.default import ensure_default_model  # torch: only when a replica is wanted

    ensure_default_model(state_dir)  # built once here, not raced inside the replica's start
    replica = ReplicaProcess(free_port(), replica_id=REPLICA_ID, log_path=log_path,
                             env={STATE_DIR_ENV: str(state_dir)},
                             extra_args=("--num-threads", str(threads), "--max-num-seqs",
                                         str(REPLICA_MAX_NUM_SEQS), "--max-waiting-requests",
                                         str(REPLICA_MAX_WAITING),
                                         *(("--cpus", cpu_list(cpus)) if cpus else ())))
    replica.start()
    return replica


def gateway_counters(url: str) -> dict[str, float]:
    """Retries, resumes and refusals the gateway counted: any of them would spoil the comparison."""
    page = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    totals = {"retries": 0.0, "resumes": 0.0, "rejected": 0.0}
    for family in text_string_to_metric_families(page):
        name = family.name.removeprefix("llmsre_gateway_")
        if name in totals:
            totals[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


@dataclass(slots=True, frozen=True)
class BenchStack:
    urls: dict[Route, str]
    gateway: GatewayProcess | GatewayThread


@contextlib.contextmanager
def bench_stack(*, state_dir: Path, log_dir: Path, replica_threads: int, gateway_mode: GatewayMode,
                layout: CpuLayout = SHARED) -> Iterator[BenchStack]:
    """One ready replica and one ready gateway over it; both stopped on the way out, whatever happens."""
    replica = start_replica(state_dir, log_dir / "replica.log", replica_threads, layout.replica)
    gateway: GatewayProcess | GatewayThread | None = None
    try:
        replica.wait_ready(REPLICA_READY_TIMEOUT_S)
        endpoint = ReplicaEndpoint(REPLICA_ID, replica.zone, "127.0.0.1", replica.port, ReplicaState.READY,
                                   MODEL, pid=replica.process.pid if replica.process else None)
        port = free_port()
        gateway = GatewayProcess(port, endpoint, layout.front, workdir=log_dir) if gateway_mode == "process" \
            else GatewayThread(port, endpoint)
        gateway.start()
        url = f"http://127.0.0.1:{port}"
        wait_gateway_ready(gateway, url)
        logger.info("[%s] replica on %s, gateway (%s) on %s", REPLICA_ID, replica.base_url, gateway_mode, url)
        yield BenchStack({"direct": replica.base_url, "gateway": url}, gateway)
    finally:
        if gateway is not None:
            gateway.stop()
        replica.stop(STOP_TIMEOUT_S)


# ---- the run ---------------------------------------------------------------------------------
def run_gateway_bench(levels: Sequence[int] = DEFAULT_LEVELS,
                      requests_per_level: int | Sequence[int] = DEFAULT_REQUESTS, *,
                      round_size: int = DEFAULT_ROUND_SIZE, max_tokens: int = DEFAULT_MAX_TOKENS,
                      replica_threads: int | None = None, gateway_mode: GatewayMode = "process",
                      layout: LayoutKind = "pinned", state_dir: Path | None = None,
                      level_timeout_s: float = LEVEL_TIMEOUT_S,
                      control_plane: ControlPlaneLoad = "idle") -> GatewayBenchResult:
    """Start a replica and a gateway, run every level, stop both. ``state_dir`` holds the default
    model (a fresh temporary folder when None); ``requests_per_level``: one count, or one per level;
    ``replica_threads``: torch threads, by default one per replica CPU when pinned, else 2."""
    counts = _counts(levels, requests_per_level)
    cpu_layout = CpuLayout.choose(layout)
    threads = replica_threads or (len(cpu_layout.replica) or REPLICA_THREADS)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        state = Path(tmp) if state_dir is None else state_dir
        busy = BusyControlPlane(cpu_layout.front, Path(tmp) / "busy.log")
        with bench_stack(state_dir=state, log_dir=Path(tmp), replica_threads=threads,
                         gateway_mode=gateway_mode, layout=cpu_layout) as stack, \
                load_thread(cpu_layout.front) as client_policy, \
                (busy if control_plane == "busy" else contextlib.nullcontext()):
            results = tuple(_run_level_bounded(stack, concurrency, count, round_size=round_size,
                                               max_tokens=max_tokens, timeout_s=level_timeout_s)
                            for concurrency, count in zip(levels, counts))
            counters = gateway_counters(stack.urls["gateway"])
            load_after = os.getloadavg()
        note = busy.summary() if control_plane == "busy" else ""
    cpus = os.cpu_count() or 0
    machine = MachineNote(cpus, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus,
                          load_before, load_after)
    return GatewayBenchResult(results, machine, gateway_mode, round_size, max_tokens, threads,
                              REPLICA_MAX_NUM_SEQS, cpu_layout, counters, client_policy, control_plane, note)


def _counts(levels: Sequence[int], requests_per_level: int | Sequence[int]) -> list[int]:
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"levels must be concurrencies >= 1, got {list(levels)}")
    counts = [requests_per_level] * len(levels) if isinstance(requests_per_level, int) \
        else list(requests_per_level)
    if len(counts) != len(levels):
        raise ValueError(f"{len(counts)} request counts for {len(levels)} levels")
    return counts


def _run_level_bounded(stack: BenchStack, concurrency: int, num_requests: int, *, round_size: int,
                       max_tokens: int, timeout_s: float) -> LevelResult:
    async def bounded() -> LevelResult:
        async with asyncio.timeout(timeout_s):
            started, cpu_before = time.perf_counter(), stack.gateway.cpu_seconds()
            samples = await run_load(stack.urls, concurrency=concurrency, num_requests=num_requests,
                                     round_size=round_size, max_tokens=max_tokens)
            cpu_after = stack.gateway.cpu_seconds()
            cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
            return LevelResult(concurrency, tuple(samples), time.perf_counter() - started, cpu)

    try:
        result = asyncio.run(bounded())
    except TimeoutError as exc:
        raise BenchError(f"level C={concurrency} did not finish within {timeout_s:g}s") from exc
    logger.info("C=%d: %d requests in %.1f s, %d failed", concurrency, num_requests, result.wall_s,
                len(result.failures))
    return result


# ---- the CLI ---------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--levels", type=_int_list, default=",".join(map(str, DEFAULT_LEVELS)),
                   help="concurrent streams, comma-separated (default: %(default)s)")
    p.add_argument("--requests", type=_int_list, default=",".join(map(str, DEFAULT_REQUESTS)),
                   help="requests per level, both routes together: one count for all levels or one per "
                   "level (default: %(default)s)")
    p.add_argument("--round-size", type=int, default=DEFAULT_ROUND_SIZE,
                   help="requests per round on one route before switching (at least C; default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--replica-threads", type=int, default=None,
                   help="torch threads of the replica (default: one per replica CPU when pinned, else "
                   f"{REPLICA_THREADS})")
    p.add_argument("--layout", choices=("pinned", "shared"), default="pinned",
                   help="pinned: the replica on the upper half of the CPUs, the gateway and the load client "
                   "on the lower half (default); shared: anywhere")
    p.add_argument("--gateway-in-thread", action="store_true",
                   help="serve the gateway on a thread of the load client's process instead of its own "
                   "process (shares the GIL: inflates the added latency)")
    p.add_argument("--level-timeout", type=float, default=LEVEL_TIMEOUT_S,
                   help="seconds one level may take (default: %(default)s)")
    p.add_argument("--samples", type=Path, default=None, metavar="FILE",
                   help="also write every request as a JSON line (mode, level, route, round, counted, "
                   "TTFT, E2E, the replica's queue and prefill, error), to analyse a run again")
    p.add_argument("--control-plane", type=_loads, default="idle,busy",
                   help="run every level with the control plane idle, busy (what-if simulations and drill "
                   "reports beside the gateway, on its CPUs), or both in turn (default: %(default)s)")


def _loads(text: str) -> list[ControlPlaneLoad]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names or any(n not in ("idle", "busy") for n in names):
        raise argparse.ArgumentTypeError(f"expected idle, busy or idle,busy, got {text!r}")
    return names  # type: ignore[return-value]  # checked above


def gateway_main(args: argparse.Namespace) -> int:
    requests = args.requests[0] if len(args.requests) == 1 else args.requests
    results: list[GatewayBenchResult] = []
    for load in args.control_plane:
        result = run_gateway_bench(args.levels, requests, round_size=args.round_size,
                                   max_tokens=args.max_tokens, replica_threads=args.replica_threads,
                                   layout=args.layout,
                                   gateway_mode="thread" if args.gateway_in_thread else "process",
                                   level_timeout_s=args.level_timeout, control_plane=load)
        print(format_report(result), end="\n\n", flush=True)
        if args.samples is not None:
            with args.samples.open("w" if not results else "a") as out:
                out.writelines(f"{line}\n" for line in sample_lines(result))
        results.append(result)
    overall = worst([r.outcome for r in results])
    if len(results) > 1:
        print(f"all runs: {overall.upper()}")
    return EXIT_CODES[overall]
