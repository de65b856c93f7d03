"""``python -m controlplane.bench soak --minutes 30``: the whole system under a steady load for a long time,
with a fault now and then, watched for leaks.

It starts a real ``controlplane up`` (its own state folder and free ports; autoscaler, alerts and console
off, so that nothing else resizes the fleet or takes the CPU; Prometheus on), measures the fleet's
capacity with the load client in a closed loop (``python -m inference.bench serve --concurrency``), then
runs the load client for ``--minutes`` at ``--load-fraction`` of that capacity (Poisson arrivals) with a
mix of streamed, non-streamed, cancelled and invalid requests (``serve --mix``). Every ``--fault-every``
seconds it injects a fault drawn from the catalogue (a seeded draw among the kinds this control plane
offers) into one replica through the chaos API; each fault reverts by its own duration. Every
``--sample-s`` seconds it records the RSS and open file descriptors of every process (control plane,
gateways, replicas, Prometheus, the fork server), their asyncio tasks (``llmsre_asyncio_tasks`` on each
``/metrics``), each replica's KV blocks in use, the store's size and row counts and Prometheus' head
series. Once the load has stopped and the replicas have drained, it reads every replica's KV blocks in
use once more.

The targets and the report are :mod:`controlplane.bench.soak_report`; the exit status is 0 when every target
is met, 1 when one is missed, 2 when the soak could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import secrets
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from chaos.drill_bench import quiet_base_port
from controlplane.bench.fleet import stop_up
from controlplane.bench.soak_report import (
    FaultWindow,
    ProcessSample,
    Sample,
    SoakResult,
    format_report,
    judge,
    write_html,
)
from controlplane.client import ApiError, ControlPlaneClient
from controlplane.errors import ControlPlaneError
from inference.bench.report import read_jsonl
from inference.environment import child_environment
from inference.launcher import free_port
from inference.metrics import KV_BLOCKS_IN_USE
from inference.runtime_metrics import ASYNCIO_TASKS

START_TIMEOUT_S = 300.0  # `controlplane up` to every replica ready, on a busy 2-core machine
STOP_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 120.0
HTTP_TIMEOUT_S = 10.0
TICK_S = 1.0
DEFAULT_MIX = "stream=0.7,plain=0.15,cancel=0.1,bad=0.05"
# The faults a soak draws from (kind, params, duration): each hits one replica and ends by itself.
FAULT_MENU: tuple[tuple[str, dict[str, Any], float], ...] = (
    ("kill", {}, 1.0), ("terminate", {}, 1.0), ("crash", {}, 1.0), ("pause", {}, 8.0), ("hang", {}, 8.0),
    ("device_failure", {}, 8.0), ("kv_pressure", {"fraction": 0.9}, 20.0),
    ("token_latency", {"seconds": 0.05}, 20.0), ("prefill_delay", {"seconds": 0.3}, 20.0),
    ("error_rate", {"probability": 0.5, "status_code": 503}, 15.0),
    ("link-delay", {"latency_ms": 50, "jitter_ms": 10}, 20.0),
    ("link-abort", {"mode": "reset", "after_ms": 300}, 10.0),
)


# Prometheus keeps each series' newest samples in memory, in head chunks of 120 samples, and its resident
# set climbs until the first chunks are cut and written out, then levels off. Measured with Prometheus 2.42
# scraping 360 series every 0.5 s: 53 -> 62 MiB over its first 105 s (steps at 60 and 100 s), then +1.4%
# over the next 100 s. Its warm-up is therefore two chunks' worth of scrapes from its start.
PROMETHEUS_WARMUP_SCRAPES = 2 * 120


class SoakError(ControlPlaneError, RuntimeError):
    """The soak could not run to the end (the control plane did not start, the load client failed)."""


@dataclass(slots=True, frozen=True)
class SoakConfig:
    minutes: float = 30.0
    replicas: int = 3
    sample_s: float = 30.0
    fault_every_s: float = 180.0
    load_fraction: float = 0.7
    mix: str = DEFAULT_MIX
    input_len: int = 32
    max_tokens: int = 24
    capacity_s: float = 30.0
    capacity_concurrency: int = 0  # 0: 6 streams per replica
    scrape_interval_s: float = 2.0  # Prometheus' (the product's default)
    recovery_s: float = 10.0  # a fault window lasts this long past its revert and the fleet's repair
    seed: int = 0
    workdir: Path | None = None

    def __post_init__(self) -> None:
        if min(self.minutes, self.sample_s, self.fault_every_s, self.capacity_s, self.scrape_interval_s) <= 0:
            raise ValueError("minutes, sample_s, fault_every_s, capacity_s and scrape_interval_s: "
                             "must be > 0")
        if not 0 < self.load_fraction <= 1:
            raise ValueError(f"load_fraction: must be in (0, 1], got {self.load_fraction}")
        if self.replicas < 2:
            raise ValueError("replicas: a soak with faults needs at least 2")

    @property
    def duration_s(self) -> float:
        return self.minutes * 60


@dataclass(slots=True)
class _Fault:
    window_start: float
    kind: str
    target: str
    fault_ids: tuple[int, ...]
    ends_at: float  # its own duration has run out (wall)
    error: str | None = None
    closed_at: float | None = None


@dataclass(slots=True)
class _ControlPlane:
    process: subprocess.Popen[bytes]
    api: str
    gateway: str
    prometheus: str
    token: str
    state: Path

    def client(self) -> ControlPlaneClient:
        return ControlPlaneClient(self.api, self.token)


# ---- the processes --------------------------------------------------------------------------------
@contextlib.contextmanager
def control_plane(cfg: SoakConfig, workdir: Path) -> Iterator[_ControlPlane]:
    """``controlplane up`` of our own on free loopback ports, stopped (SIGTERM: it drains) at the end."""
    ports = {name: free_port() for name in ("api", "gateway", "prometheus", "console")}
    state = workdir / "state"
    config = workdir / "controlplane.toml"
    config.write_text(f'state_dir = "{state}"\n[api]\nport = {ports["api"]}\n[gateway]\nport = '
                      f'{ports["gateway"]}\n[fleet]\nreplicas = {cfg.replicas}\n'
                      f"base_port = {quiet_base_port(cfg.replicas * 4)}\n[prometheus]\nport = "
                      f'{ports["prometheus"]}\nscrape_interval_s = {cfg.scrape_interval_s!r}\n'
                      '[autoscaler]\nenabled = false\n[alerts]\nenabled = false\n'
                      "[console]\nenabled = false\n")
    token = secrets.token_urlsafe(24)
    with (workdir / "up.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "controlplane", "up", "--config", str(config)],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env=child_environment({"CONTROLPLANE_ADMIN_TOKEN": token,
                                                          "PYTHONUNBUFFERED": "1"}))
    cp = _ControlPlane(process, f"http://127.0.0.1:{ports['api']}", f"http://127.0.0.1:{ports['gateway']}",
                       f"http://127.0.0.1:{ports['prometheus']}", token, state)
    try:
        yield cp
    finally:
        stop_up(process, STOP_TIMEOUT_S)


def wait_ready(cp: _ControlPlane, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cp.process.poll() is not None:
            raise SoakError(f"controlplane up exited with status {cp.process.returncode}; see its log")
        with contextlib.suppress(ApiError, httpx.HTTPError), cp.client() as client:
            fleet = client.fleet()
            if fleet.ready_replicas >= fleet.desired_replicas > 0 and fleet.rollout is None:
                return
        time.sleep(1.0)
    raise SoakError(f"the fleet was not ready within {timeout_s:g}s")


def load_client(cp: _ControlPlane, workdir: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "inference.bench", "serve", "--base-url", cp.gateway, "--no-progress",
               "--jsonl", str(workdir / f"{name}.jsonl"), "--result-json", str(workdir / f"{name}.json"),
               *args]
    with (workdir / f"{name}.log").open("wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_environment())


def measure_capacity(cp: _ControlPlane, cfg: SoakConfig, workdir: Path) -> float:
    """Completed requests per second of the soak's request shape in a closed loop that keeps every
    replica busy (streams only)."""
    concurrency = cfg.capacity_concurrency or 6 * cfg.replicas
    load = load_client(cp, workdir, "capacity", "--concurrency", str(concurrency), "--num-requests",
                       "100000", "--duration", f"{cfg.capacity_s:g}", "--grace", "60", "--input-len",
                       str(cfg.input_len), "--output-len", str(cfg.max_tokens), "--seed", str(cfg.seed))
    if load.wait(cfg.capacity_s + 180) != 0:
        raise SoakError(f"the capacity run failed; see {workdir / 'capacity.log'}")
    summary = json.loads((workdir / "capacity.json").read_text())
    if summary["num_failed"]:
        raise SoakError(f"the capacity run had {summary['num_failed']} failed requests; see its log")
    return float(summary["request_throughput"])


# ---- sampling -------------------------------------------------------------------------------------
class Sampler:
    """Reads every quantity the soak watches, from /proc, the /metrics pages, the store and Prometheus."""

    def __init__(self, cp: _ControlPlane, load_start_wall: float, scrape_interval_s: float) -> None:
        self.cp, self.load_start_wall = cp, load_start_wall
        self.prometheus_warmup_s = PROMETHEUS_WARMUP_SCRAPES * scrape_interval_s
        self.http = httpx.Client(timeout=HTTP_TIMEOUT_S, trust_env=False)

    def close(self) -> None:
        self.http.close()

    def metrics(self, url: str, headers: Mapping[str, str] | None = None) -> dict[str, float]:
        """The samples of a /metrics page summed by name ({} when it does not answer)."""
        try:
            response = self.http.get(url, headers=headers)
            if response.status_code != 200:
                return {}
            out: dict[str, float] = {}
            for family in text_string_to_metric_families(response.text):
                for s in family.samples:
                    out[s.name] = out.get(s.name, 0.0) + s.value
            return out
        except (httpx.HTTPError, ValueError):
            return {}

    def sample(self) -> Sample:
        with self.cp.client() as client:
            fleet = client.fleet()
            gateways = client.gateways()
        auth = {"Authorization": f"Bearer {self.cp.token}"}
        processes = [_process("control-plane", self.cp.process.pid,
                              self.metrics(f"{self.cp.api}/metrics", auth).get(ASYNCIO_TASKS))]
        gateway_tasks = self.metrics(f"{self.cp.gateway}/metrics").get(ASYNCIO_TASKS)
        for g in gateways:
            if g.pid is not None:  # with one gateway process, the data port's /metrics is its own
                processes.append(_process(f"gateway {g.name}", g.pid, gateway_tasks if len(gateways) == 1
                                          else None))
        kv: dict[str, int] = {}
        running: dict[str, int] = {}
        for r in fleet.replicas:
            if r.pid is None or r.state in ("stopped", "crashed"):
                continue
            page = self.metrics(f"{r.url}/metrics")
            processes.append(_process(f"replica {r.replica_id}", r.pid, page.get(ASYNCIO_TASKS)))
            if KV_BLOCKS_IN_USE in page:
                kv[r.replica_id] = int(page[KV_BLOCKS_IN_USE])
                running[r.replica_id] = int(page.get("vllm:num_requests_running", 0))
        children = _children(self.cp.process.pid)
        processes += [_process("prometheus", pid, None, warmup_s=self.prometheus_warmup_s,
                               since=self.load_start_wall) for pid in children.get("prometheus", ())]
        # the fork server holds a pidfd per live replica it forked: a restart that leaks one shows here
        processes += [_process("fork-server", pid, None) for pid in children.get("fork-server", ())]
        return Sample(t=round(time.time() - self.load_start_wall, 3), wall=time.time(),
                      processes=tuple(p for p in processes if p is not None), kv_blocks_in_use=kv,
                      requests_running=running, store_bytes=_store_bytes(self.cp.state),
                      store_rows=_store_rows(self.cp.state), prometheus_series=self._series(),
                      ready=fleet.ready_replicas, desired=fleet.desired_replicas)

    def _series(self) -> int | None:
        try:
            body = self.http.get(f"{self.cp.prometheus}/api/v1/status/tsdb").json()
            return int(body["data"]["headStats"]["numSeries"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None


def _process(role: str, pid: int, tasks: float | None, *, warmup_s: float | None = None,
             since: float = 0.0) -> ProcessSample | None:
    """One process's sample; with ``warmup_s``, when its own warm-up ends (its start plus that, in seconds
    since ``since``, the load's start)."""
    try:
        p = psutil.Process(pid)
        warm_from = None if warmup_s is None else round(p.create_time() + warmup_s - since, 3)
        established = sum(1 for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED)
        return ProcessSample(role, pid, int(p.memory_info().rss), int(p.num_fds()),
                             None if tasks is None else int(tasks), warm_from, established)
    except psutil.Error:
        return None


def _children(root: int) -> dict[str, list[int]]:
    """The control plane's own children the soak watches beside the fleet's processes, by role: Prometheus
    and the fork server the local replicas are forked from (the replicas are its children)."""
    try:
        children = psutil.Process(root).children()
    except psutil.Error:
        return {}
    out: dict[str, list[int]] = {}
    for child in children:
        with contextlib.suppress(psutil.Error):
            if child.name() == "prometheus":
                out.setdefault("prometheus", []).append(child.pid)
            elif "inference.forkserver" in child.cmdline():
                out.setdefault("fork-server", []).append(child.pid)
    return out


def _store_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in state.glob("controlplane.db*") if p.is_file())


def _store_rows(state: Path) -> dict[str, int]:
    """Rows per table, read through a read-only connection (the control plane keeps writing)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{state / 'controlplane.db'}?mode=ro", uri=True,
                                                timeout=5)) as db:
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            return {t: int(db.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]) for t in tables}
    except sqlite3.Error:
        return {}


# ---- faults ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class FaultPlan:
    """When and what: a fault every ``every_s`` from ``every_s`` on, none that would still be open in the
    last ``quiet_s`` of the load (the drain at the end must see a fleet at rest)."""

    every_s: float
    duration_s: float
    quiet_s: float
    rng: random.Random
    kinds: list[tuple[str, dict[str, Any], float]] = field(default_factory=list)

    def due(self, n: int) -> float:
        return (n + 1) * self.every_s

    def fits(self, at_s: float, fault_s: float) -> bool:
        return at_s + fault_s + self.quiet_s <= self.duration_s

    def draw(self) -> tuple[str, dict[str, Any], float]:
        return self.rng.choice(self.kinds)


def available_faults(client: ControlPlaneClient) -> list[tuple[str, dict[str, Any], float]]:
    offered = {k.kind for k in client.chaos_catalogue() if k.available}
    return [f for f in FAULT_MENU if f[0] in offered]


def inject(client: ControlPlaneClient, rng: random.Random, kind: str, params: dict[str, Any],
           duration_s: float) -> _Fault:
    ready = sorted(r.replica_id for r in client.fleet().replicas if r.state == "ready")
    target = rng.choice(ready) if ready else "-"
    start = time.time()
    try:
        injection = client.chaos_inject(kind, duration_s=duration_s, params=params, replicas=[target])
        errors = [f.error for f in injection.faults if f.error]
        ids = tuple(f.id for f in injection.faults if f.id is not None)
        error = "; ".join(errors) or (None if ids else "no fault went in")
    except ApiError as exc:
        ids, error = (), str(exc)
    print(f"soak: t={start:.0f} {kind} on {target}" + (f": {error}" if error else ""), flush=True)
    return _Fault(start, kind, target, ids, start + duration_s, error)


def close_windows(client: ControlPlaneClient, faults: list[_Fault], recovery_s: float) -> None:
    """A fault's window closes once its duration ran out, it is no longer active and the fleet is whole."""
    open_ = [f for f in faults if f.closed_at is None and time.time() >= f.ends_at]
    if not open_:
        return
    active = {f.id for f in client.chaos_faults()}
    fleet = client.fleet()
    whole = fleet.ready_replicas >= fleet.desired_replicas and fleet.rollout is None
    for f in open_:
        if whole and not active.intersection(f.fault_ids):
            f.closed_at = time.time() + recovery_s


# ---- the run --------------------------------------------------------------------------------------
def run_soak(cfg: SoakConfig) -> SoakResult:
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"soak: working in {workdir}", flush=True)
    with control_plane(cfg, workdir) as cp:
        wait_ready(cp)
        capacity = measure_capacity(cp, cfg, workdir)
        rate = round(cfg.load_fraction * capacity, 3)
        print(f"soak: capacity {capacity:.2f} req/s; load {rate:.2f} req/s for {cfg.minutes:g} min",
              flush=True)
        wait_ready(cp)
        return _soak(cp, cfg, workdir, capacity, rate)


def _soak(cp: _ControlPlane, cfg: SoakConfig, workdir: Path, capacity: float, rate: float) -> SoakResult:
    rng = random.Random(cfg.seed)
    with cp.client() as client:
        plan = FaultPlan(cfg.fault_every_s, cfg.duration_s, quiet_s=max(cfg.sample_s, 60.0), rng=rng,
                         kinds=available_faults(client))
    num = math.ceil(rate * cfg.duration_s * 1.3) + 100
    load = load_client(cp, workdir, "load", "--request-rate", f"{rate:g}", "--num-requests", str(num),
                       "--duration", f"{cfg.duration_s:g}", "--grace", "60", "--request-timeout", "120",
                       "--input-len", str(cfg.input_len), "--output-len", str(cfg.max_tokens),
                       "--mix", cfg.mix, "--cancel-after", "2", "--seed", str(cfg.seed))
    start = time.time()
    sampler = Sampler(cp, start, cfg.scrape_interval_s)
    samples: list[Sample] = []
    faults: list[_Fault] = []
    try:
        with cp.client() as client:
            next_sample = 0.0
            while load.poll() is None:
                now = time.time() - start
                if cp.process.poll() is not None:
                    raise SoakError(f"the control plane exited ({cp.process.returncode}) during the soak")
                if now >= next_sample:
                    samples.append(sampler.sample())
                    next_sample += cfg.sample_s
                n = len(faults)
                if plan.kinds and now >= plan.due(n):
                    kind, params, duration = plan.draw()
                    if plan.fits(now, duration + cfg.recovery_s):
                        faults.append(inject(client, rng, kind, params, duration))
                    else:
                        plan.kinds = []  # too late in the run for another one
                close_windows(client, faults, cfg.recovery_s)
                time.sleep(TICK_S)
            if load.returncode != 0:
                raise SoakError(f"the load client exited with status {load.returncode}; see "
                                f"{workdir / 'load.log'}")
            for f in faults:  # anything still open ends now (its own duration has run out by far)
                f.closed_at = f.closed_at or time.time() + cfg.recovery_s
            kv_after = drain(sampler, client)
            samples.append(sampler.sample())
    finally:
        sampler.close()
        if load.poll() is None:
            load.kill()
    records = read_jsonl(workdir / "load.jsonl")
    windows = [FaultWindow(f.kind, f.target, f.window_start, f.closed_at or f.ends_at + cfg.recovery_s,
                           f.error) for f in faults]
    config = {**asdict(cfg), "workdir": str(workdir)}
    result = SoakResult(config, capacity, rate, start, samples, windows, records, kv_after)
    result.verdicts = judge(result, min_span_s=cfg.duration_s / 3)
    return result


def drain(sampler: Sampler, client: ControlPlaneClient) -> dict[str, int | None]:
    """Once nothing runs on any replica (the load has stopped): every replica's KV blocks in use."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        pages = {r.replica_id: sampler.metrics(f"{r.url}/metrics") for r in client.fleet().replicas
                 if r.state == "ready"}
        busy = {rid: page.get("vllm:num_requests_running", 0) + page.get("vllm:num_requests_waiting", 0)
                for rid, page in pages.items()}
        if (pages and not any(busy.values())) or time.monotonic() > deadline:
            return {rid: None if KV_BLOCKS_IN_USE not in page else int(page[KV_BLOCKS_IN_USE])
                    for rid, page in pages.items()}
        time.sleep(1.0)


# ---- the CLI --------------------------------------------------------------------------------------
def add_soak_arguments(p: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    p.add_argument("--minutes", type=float, default=d.minutes, help="load duration (default %(default)s)")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--sample-s", type=float, default=d.sample_s, help="sampling period (default %(default)s)")
    p.add_argument("--fault-every", type=float, default=d.fault_every_s, metavar="S",
                   help="a fault every S seconds (default %(default)s)")
    p.add_argument("--load-fraction", type=float, default=d.load_fraction,
                   help="of the measured capacity (default %(default)s)")
    p.add_argument("--mix", default=d.mix,
                   help="request kinds, as the load client's --mix (default %(default)s)")
    p.add_argument("--capacity-s", type=float, default=d.capacity_s, help="seconds of the capacity run")
    p.add_argument("--scrape-interval-s", type=float, default=d.scrape_interval_s,
                   help="Prometheus' scrape interval; its warm-up is 240 scrapes (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--workdir", type=Path, default=None, help="state, logs and records (default: a temp dir)")
    p.add_argument("--html", type=Path, default=None, help="write the plotly report here")
    p.add_argument("--json", type=Path, default=None, help="write the samples, windows and verdicts here")
    p.add_argument("--plotlyjs", choices=("inline", "cdn"), default="inline",
                   help="inline: a self-contained page (opens offline); cdn: a small page that loads "
                   "plotly.js from the network (default %(default)s)")
    p.add_argument("--replot", type=Path, default=None, metavar="JSON",
                   help="run nothing: draw the report of an earlier run's --json again (to --html)")


def soak_main(args: argparse.Namespace) -> int:
    if args.replot is not None:
        earlier = SoakResult.from_json(json.loads(args.replot.read_text()))
        html = args.html or args.replot.with_suffix(".html")
        write_html(earlier, html, bin_s=float(earlier.config["sample_s"]), plotlyjs=args.plotlyjs)
        print(format_report(earlier), f"report: {html}", sep="\n", flush=True)
        return 0 if earlier.outcome == "pass" else 1
    cfg = SoakConfig(minutes=args.minutes, replicas=args.replicas, sample_s=args.sample_s,
                     fault_every_s=args.fault_every, load_fraction=args.load_fraction, mix=args.mix,
                     capacity_s=args.capacity_s, scrape_interval_s=args.scrape_interval_s, seed=args.seed,
                     workdir=args.workdir)
    try:
        result = run_soak(cfg)
    except (SoakError, ApiError, httpx.HTTPError) as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    print(format_report(result), flush=True)
    workdir = Path(result.config["workdir"])
    html = args.html or workdir / "soak.html"
    write_html(result, html, bin_s=cfg.sample_s, plotlyjs=args.plotlyjs)
    (args.json or workdir / "soak.json").write_text(json.dumps(result.to_json(), indent=1))
    print(f"report: {html}", flush=True)
    return 0 if result.outcome == "pass" else 1
