"""``python -m controlplane.bench gateway``: the latency the gateway adds to a stream, against the replica.

Beside the request path, not in it: one real replica (``python -m inference serve``) and one
:class:`~controlplane.gateway.handler.Gateway` over it (a static endpoint list), both on loopback. A closed
loop of C workers sends streaming ``/v1/completions`` requests, in rounds that alternate between the replica
itself and the gateway (ABBA order, so drift and machine noise fall on both routes alike; the load is
:mod:`controlplane.bench.load`). Per request it records the client's TTFT (send -> first chunk with a choice,
i.e. the first token) and E2E (send -> ``[DONE]``) with the replica's own queue and prefill times from the
``timings`` of its last chunk.

The gateway's added latency is estimated two ways: the difference of the routes' TTFT percentiles, and
per request as client TTFT - replica (queue + prefill), gateway minus direct, which takes out the
engine's share of each TTFT. Each added TTFT percentile comes with a 95% interval from resampling whole
rounds (:mod:`controlplane.bench.stats`). By default the gateway runs in its own process: served from a
thread of the client's process it would share one GIL with the load client, whose timestamps would then
wait on the gateway's relaying (the switch interval alone is 5 ms), inflating what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from controlplane.bench.load import MODEL, ROUTES, RequestSample, Route, run_load
from controlplane.bench.stats import AddedIntervals, Interval, Percentiles, added_interval
from controlplane.config import STATE_DIR_ENV
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.handler import Gateway
from controlplane.gateway.server import create_gateway_app
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from inference.launcher import ReplicaProcess, free_port, unwind_on_sigterm

logger = logging.getLogger(__name__)

GatewayMode = Literal["process", "thread"]
LayoutKind = Literal["pinned", "shared"]

TARGET_ADDED_P50_S = 0.002
TARGET_ADDED_P99_S = 0.010
DEFAULT_LEVELS = (1, 16, 64)
DEFAULT_REQUESTS = (400, 4096, 8192)  # per level, both routes together, warm-up not included
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


class BenchError(RuntimeError):
    """The benchmark could not run to the end (a process did not start, a level ran out of time)."""


# ---- where the processes run -----------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class CpuLayout:
    """``pinned``: the replica on its own CPUs (the upper half), the gateway and the load client on the
    others. A replica's model runs on an accelerator, not on the cores that serve HTTP; on a CPU-only
    machine whose replica computes on every core, the gateway's CPU time would instead come out of the
    model's matrix products, and what the benchmark measured would be the core count. The load client
    stays off the replica's CPUs too: there, each chunk the gateway sends it from another CPU waits for
    the model's compute to yield (about 2 ms at one stream), a delay the direct route, woken from the
    replica's own CPU, does not see. ``shared``: all three wherever the scheduler puts them (the only
    choice with one usable CPU)."""

    kind: LayoutKind
    replica: tuple[int, ...] = ()
    front: tuple[int, ...] = ()  # the gateway and the load client

    @classmethod
    def choose(cls, kind: LayoutKind) -> CpuLayout:
        usable = sorted(os.sched_getaffinity(0))
        if kind == "shared" or len(usable) < 2:
            return cls("shared")
        half = len(usable) // 2
        return cls("pinned", tuple(usable[half:]), tuple(usable[:half]))

    def describe(self) -> str:
        if self.kind == "shared":
            return "shared (replica, gateway and load client on any CPU)"
        return (f"pinned (replica on CPUs {_cpus(self.replica)}; gateway and load client on "
                f"{_cpus(self.front)})")


def _cpus(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus))


@contextlib.contextmanager
def _load_thread(cpus: Sequence[int]) -> Iterator[str]:
    """This thread (the load client's event loop) on ``cpus`` (when any) and under ``SCHED_BATCH`` for
    the block; yields the scheduling policy it runs under, for the report.

    The load client stands in for clients on other machines, yet shares its CPU with the gateway. Under
    the default policy a task woken by a socket preempts the one running, so each chunk the gateway
    writes stopped the gateway mid-relay to let the client read it: about 900 times a second at 64
    streams, and the gateway spent about a fifth more CPU per request (1.12 against 0.91 ms) switching
    back and forth. ``SCHED_BATCH`` tasks do not preempt on wake-up; they still get their fair share of
    the CPU. On the direct route the client's CPU is otherwise idle, so nothing changes there."""
    before_cpus = os.sched_getaffinity(0) if cpus else None
    before_policy = os.sched_getscheduler(0)
    policy = "default"
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        policy = "SCHED_BATCH"
    except (AttributeError, OSError) as exc:
        policy = f"default (SCHED_BATCH unavailable: {exc})"
    try:
        yield policy
    finally:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, before_policy, os.sched_param(0))
        if before_cpus is not None:
            os.sched_setaffinity(0, before_cpus)


# ---- records ---------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class RouteStats:
    """One route at one level: successful requests only."""

    num_requests: int
    num_succeeded: int
    ttft: Percentiles
    e2e: Percentiles
    overhead: Percentiles  # per request: client TTFT - replica queue - replica prefill

    @classmethod
    def of(cls, samples: Sequence[RequestSample]) -> RouteStats:
        ok = [s for s in samples if s.is_success]
        return cls(num_requests=len(samples), num_succeeded=len(ok),
                   ttft=Percentiles.of([s.ttft_s for s in ok if s.ttft_s is not None]),
                   e2e=Percentiles.of([s.e2e_s for s in ok if s.e2e_s is not None]),
                   overhead=Percentiles.of([s.overhead_s for s in ok]))


@dataclass(slots=True, frozen=True)
class LevelResult:
    concurrency: int
    samples: tuple[RequestSample, ...]
    wall_s: float
    gateway_cpu_s: float | None = None  # the gateway process's CPU time over the level (None: unknown)
    direct: RouteStats = field(init=False)
    gateway: RouteStats = field(init=False)

    def __post_init__(self) -> None:
        for route in ROUTES:
            object.__setattr__(self, route, RouteStats.of([s for s in self.counted if s.route == route]))

    @property
    def counted(self) -> list[RequestSample]:
        return [s for s in self.samples if s.counted]

    @property
    def added_ttft(self) -> Percentiles:
        """The estimate judged against the targets: gateway TTFT percentile - direct TTFT percentile."""
        return self.gateway.ttft.minus(self.direct.ttft)

    @property
    def added_ttft_interval(self) -> AddedIntervals:
        """95% intervals of :attr:`added_ttft`, from resampling rounds (:mod:`controlplane.bench.stats`)."""
        rounds: dict[Route, dict[int, list[float]]] = {route: {} for route in ROUTES}
        for s in self.counted:
            if s.is_success and s.ttft_s is not None:
                rounds[s.route].setdefault(s.round_index, []).append(s.ttft_s)
        return added_interval(list(rounds["direct"].values()), list(rounds["gateway"].values()))

    @property
    def added_overhead(self) -> Percentiles:
        return self.gateway.overhead.minus(self.direct.overhead)

    @property
    def added_e2e(self) -> Percentiles:
        return self.gateway.e2e.minus(self.direct.e2e)

    @property
    def gateway_cpu_per_request_s(self) -> float | None:
        """The gateway's CPU time per request it relayed, warm-up included (it spent CPU on those too)."""
        relayed = sum(1 for s in self.samples if s.route == "gateway")
        return None if self.gateway_cpu_s is None or not relayed else self.gateway_cpu_s / relayed

    @property
    def failures(self) -> list[RequestSample]:
        return [s for s in self.samples if not s.is_success]

    @property
    def is_pass(self) -> bool:
        added = self.added_ttft
        return not self.failures and added.p50 <= TARGET_ADDED_P50_S and added.p99 <= TARGET_ADDED_P99_S


@dataclass(slots=True, frozen=True)
class MachineNote:
    num_cpus: int
    num_usable_cpus: int  # this process's affinity
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]

    def line(self) -> str:
        def load(values: tuple[float, float, float]) -> str:
            return " ".join(f"{v:.2f}" for v in values)

        return (f"machine: {self.num_cpus} CPUs ({self.num_usable_cpus} usable); load average 1/5/15 min "
                f"before {load(self.load_before)}, after {load(self.load_after)}")


@dataclass(slots=True, frozen=True)
class GatewayBenchResult:
    levels: tuple[LevelResult, ...]
    machine: MachineNote
    gateway_mode: GatewayMode
    round_size: int
    max_tokens: int
    replica_threads: int
    layout: CpuLayout
    gateway_counters: dict[str, float]  # retries, resumes, rejected: all should be 0
    client_policy: str = "default"  # the load client's scheduling policy (see _load_thread)

    @property
    def is_pass(self) -> bool:
        return all(level.is_pass for level in self.levels) and not any(self.gateway_counters.values())


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


def _serve_gateway(port: int, endpoint: ReplicaEndpoint, cpus: tuple[int, ...]) -> None:
    """The gateway process's body (a module-level function, so that ``spawn`` can import it)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    server = uvicorn.Server(_uvicorn_config(port, endpoint))
    gc.freeze()  # as ``controlplane up`` does once started
    server.run()


class GatewayProcess:
    """The gateway served by uvicorn in a child process (spawned: no state inherited from this one)."""

    def __init__(self, port: int, endpoint: ReplicaEndpoint, cpus: tuple[int, ...] = ()) -> None:
        self.port, self.endpoint, self.cpus = port, endpoint, cpus
        self._process: BaseProcess | None = None

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._process = context.Process(target=_serve_gateway, args=(self.port, self.endpoint, self.cpus),
                                        name="bench-gateway", daemon=True)
        self._process.start()

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the gateway process so far (Linux ``/proc``); None where unknown."""
        pid = self._process.pid if self._process is not None else None
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        process = self._process
        if process is None or not process.is_alive():
            return
        process.terminate()  # SIGTERM: uvicorn shuts down and the lifespan stops the gateway
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_TIMEOUT_S)


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
                                         *(("--cpus", _cpus(cpus)) if cpus else ())))
    replica.start()
    return replica


def gateway_counters(url: str) -> dict[str, float]:
    """Retries, resumes and refusals the gateway counted: any of them would spoil the comparison."""
    page = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    totals = {"retries": 0.0, "resumes": 0.0, "rejected": 0.0}
    for family in text_string_to_metric_families(page):
        name = family.name.removeprefix("gateway_")
        if name in totals:
            totals[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


@dataclass(slots=True, frozen=True)
class BenchStack:
    urls: dict[Route, str]
    gateway: GatewayProcess | GatewayThread


@contextlib.contextmanager
def bench_stack(*, state_dir: Path, log_dir: Path, replica_threads: int, gateway_mode: GatewayMode,
                layout: CpuLayout = CpuLayout("shared")) -> Iterator[BenchStack]:
    """One ready replica and one ready gateway over it; both stopped on the way out, whatever happens."""
    replica = start_replica(state_dir, log_dir / "replica.log", replica_threads, layout.replica)
    gateway: GatewayProcess | GatewayThread | None = None
    try:
        replica.wait_ready(REPLICA_READY_TIMEOUT_S)
        endpoint = ReplicaEndpoint(REPLICA_ID, replica.zone, "127.0.0.1", replica.port, ReplicaState.READY,
                                   MODEL, pid=replica.process.pid if replica.process else None)
        port = free_port()
        gateway = GatewayProcess(port, endpoint, layout.front) if gateway_mode == "process" \
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
                      level_timeout_s: float = LEVEL_TIMEOUT_S) -> GatewayBenchResult:
    """Start a replica and a gateway, run every level, stop both. ``state_dir`` holds the default
    model (a fresh temporary folder when None); ``requests_per_level``: one count, or one per level;
    ``replica_threads``: torch threads, by default one per replica CPU when pinned, else 2."""
    counts = _counts(levels, requests_per_level)
    cpu_layout = CpuLayout.choose(layout)
    threads = replica_threads or (len(cpu_layout.replica) or REPLICA_THREADS)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        state = Path(tmp) if state_dir is None else state_dir
        with bench_stack(state_dir=state, log_dir=Path(tmp), replica_threads=threads,
                         gateway_mode=gateway_mode, layout=cpu_layout) as stack, \
                _load_thread(cpu_layout.front) as client_policy:
            results = tuple(_run_level_bounded(stack, concurrency, count, round_size=round_size,
                                               max_tokens=max_tokens, timeout_s=level_timeout_s)
                            for concurrency, count in zip(levels, counts))
            counters = gateway_counters(stack.urls["gateway"])
            load_after = os.getloadavg()
    cpus = os.cpu_count() or 0
    machine = MachineNote(cpus, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus,
                          load_before, load_after)
    return GatewayBenchResult(results, machine, gateway_mode, round_size, max_tokens, threads, cpu_layout,
                              counters, client_policy)


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


# ---- the report ------------------------------------------------------------------------------
def format_report(result: GatewayBenchResult) -> str:
    where = ("in its own process" if result.gateway_mode == "process"
             else "on a thread of the load client's process")
    lines = [f"gateway bench: 1 replica ({result.replica_threads} torch threads, max {REPLICA_MAX_NUM_SEQS} "
             f"seqs), gateway {where}; streaming /v1/completions, max_tokens {result.max_tokens}, greedy, "
             f"ignore_eos; closed loop, rounds of max({result.round_size}, 4 C) requests alternating direct "
             "and gateway (ABBA), with no barrier between rounds; n counts neither a warm-up of C per route "
             "nor the first C of each round", f"CPU layout: {result.layout.describe()}",
             f"load client scheduling: {result.client_policy}{_POLICY_NOTES.get(result.client_policy, '')}",
             "",
             *_table(result.levels), "",
             "TTFT: send -> first chunk with a token; E2E: send -> [DONE]. added = gateway - direct, "
             "percentile by percentile;",
             "per-request = client TTFT - replica (queue + prefill), gateway median/p99 - direct median/p99.",
             "95% CI: from resampling whole rounds of each route (the spread one run leaves); the verdict "
             "judges the estimate itself.", ""]
    lines += [_verdict(level) for level in result.levels]
    lines.append("gateway CPU per request relayed: " + ", ".join(
        f"C={level.concurrency} {_cpu_ms(level.gateway_cpu_per_request_s)}" for level in result.levels))
    counters = ", ".join(f"{name} {value:g}" for name, value in result.gateway_counters.items())
    lines += [f"gateway counters (should all be 0): {counters}", result.machine.line(),
              f"overall: {'PASS' if result.is_pass else 'FAIL'}"]
    return "\n".join(lines)


_POLICY_NOTES = {"SCHED_BATCH": " (does not preempt the gateway on wake-up)"}


def _table(levels: Sequence[LevelResult]) -> list[str]:
    groups = ("direct TTFT", "gateway TTFT", "added TTFT", "added per-req", "added E2E")
    head1 = f"{'':>4} {'':>5} {'':>6}  " + "  ".join(f"{g:^15}" for g in groups)
    names = (("p50", "p99"),) * 3 + (("median", "p99"), ("p50", "p99"))
    head2 = f"{'C':>4} {'n':>5} {'failed':>6}  " + "  ".join(f"{a:>7} {b:>7}" for a, b in names)
    rows = [head1, head2 + "   (ms)"]
    for level in levels:
        pairs = (level.direct.ttft, level.gateway.ttft, level.added_ttft, level.added_overhead,
                 level.added_e2e)
        cells = "  ".join(f"{_ms(p.p50):>7} {_ms(p.p99):>7}" for p in pairs)
        rows.append(f"{level.concurrency:>4} {len(level.counted):>5} {len(level.failures):>6}  {cells}")
    return rows


def _verdict(level: LevelResult) -> str:
    added, interval = level.added_ttft, level.added_ttft_interval
    failed = f"; {len(level.failures)} failed requests" if level.failures else ""
    return (f"C={level.concurrency}: added TTFT p50 {_ms(added.p50)} ms {_interval(interval.p50)} (target <= "
            f"{TARGET_ADDED_P50_S * 1000:g}), p99 {_ms(added.p99)} ms {_interval(interval.p99)} (target <= "
            f"{TARGET_ADDED_P99_S * 1000:g}){failed}: {'PASS' if level.is_pass else 'FAIL'}")


def _interval(interval: Interval) -> str:
    if math.isnan(interval.low):
        return "[95% CI: too few rounds]"
    return f"[95% CI {_ms(interval.low)} to {_ms(interval.high)}]"


def _cpu_ms(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds * 1000:.2f} ms"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


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


def gateway_main(args: argparse.Namespace) -> int:
    requests = args.requests[0] if len(args.requests) == 1 else args.requests
    result = run_gateway_bench(args.levels, requests, round_size=args.round_size, max_tokens=args.max_tokens,
                               replica_threads=args.replica_threads, layout=args.layout,
                               gateway_mode="thread" if args.gateway_in_thread else "process",
                               level_timeout_s=args.level_timeout)
    print(format_report(result))
    return 0 if result.is_pass else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controlplane.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    gateway = sub.add_parser("gateway", help="the gateway's added TTFT and E2E against calling a replica")
    add_gateway_arguments(gateway)
    gateway.set_defaults(func=gateway_main)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would load the client
    unwind_on_sigterm()
    try:
        return int(args.func(args))
    except (BenchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the benchmark stopped its replica and gateway", file=sys.stderr)
        return 130

