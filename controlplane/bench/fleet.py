"""``python -m controlplane.bench fleet --backend local,ray``: how fast a fleet comes up, grows and heals,
for each backend, in the same run on the same machine.

Each run of a backend starts a real ``controlplane up`` (its own state folder and free ports; autoscaler,
alerts, console and Prometheus off, so nothing else moves the fleet or takes the CPU) and measures, through
its REST API as an operator would see it:

- ``up_to_3_ready_s``: ``controlplane up`` launched -> 3 replicas ready (the control plane's own start,
  joining the cluster, placing and starting the replicas); ``spawn_to_3_ready_s`` is the fleet's share
  (first ``replica.spawned`` -> third ``replica.ready``, from its events);
- ``per_added_replica_s``: ``scale 5`` asked -> 5 ready, divided by the 2 replicas added;
- ``rto_capacity_s``: a ``kill`` fault on one replica's process (through the chaos API) -> 3 ready again.

The ``ray`` backend runs on the lab of :mod:`controlplane.lab`, built for the benchmark and torn down after
it, unless ``--ray-address`` names a cluster. ``local-exec`` is the local backend with ``[fleet]
fork_replicas = false``: each replica a fresh ``python -m inference serve``, the baseline for the forked
replicas of ``local``; with both in a run the report gives forked over exec'd for each figure, and the
command exits non-zero where a replica added or restarted is not at most :data:`FORK_TARGET` of the exec'd
one's time. The model is built before any clock starts. A failed run is reported and makes the command exit
non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from controlplane.client import ControlPlaneClient
from controlplane.errors import ControlPlaneError
from controlplane.lab.lab import Lab
from controlplane.views import FleetView
from inference.environment import child_environment
from inference.launcher import free_port
from inference.models.default import ensure_default_model

BACKENDS = ("local", "local-exec", "ray")
# A forked replica skips the 2-3 s of imports of an exec'd one; what the figures add to both (the fleet's
# 1 s health checks, the model's load and first forward pass) leaves it at about 0.3-0.5 of the time.
FORK_TARGET = 0.75
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
POLL_S = 0.1
T = TypeVar("T")
FIGURES = ("up_to_3_ready_s", "spawn_to_3_ready_s", "per_added_replica_s", "rto_capacity_s")


class FleetBenchError(ControlPlaneError, RuntimeError):
    """A run could not finish (the control plane exited, the fleet never got ready)."""


@dataclass(slots=True)
class FleetRun:
    backend: str
    run: int
    up_to_3_ready_s: float | None = None
    spawn_to_3_ready_s: float | None = None
    per_added_replica_s: float | None = None
    rto_capacity_s: float | None = None
    error: str | None = None


@dataclass(slots=True)
class FleetBenchResult:
    runs: list[FleetRun] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[FleetRun]:
        return [r for r in self.runs if r.error is not None]


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="local,ray",
                        help="comma-separated: local, local-exec (replicas exec'd, not forked), ray "
                             "(default %(default)s)")
    parser.add_argument("--runs", type=int, default=1, help="runs per backend (default %(default)s)")
    parser.add_argument("--ray-address", default=None,
                        help="a Ray cluster (ray://host:port); default: build the lab and use it")
    parser.add_argument("--out", default=None, help="write the results as JSON to this file")
    parser.add_argument("--workdir", default=None,
                        help="state folders and logs (default: a temporary folder)")


def fleet_main(args: argparse.Namespace) -> int:
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        raise ValueError(f"--backend: must name some of {', '.join(BACKENDS)}, got {args.backend!r}")
    if args.runs < 1:
        raise ValueError(f"--runs: must be >= 1, got {args.runs}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fleet-bench-"))
    result = FleetBenchResult(machine={"cpus": os.cpu_count(), "python": sys.version.split()[0]})
    with _ray_cluster(args.ray_address if "ray" in backends else "unused") as ray_address:
        for run in range(1, args.runs + 1):
            for backend in backends:  # interleaved: drift and noise fall on both backends alike
                result.runs.append(_one_run(backend, run, workdir / f"{backend}-{run}", ray_address))
    print(format_fleet_report(result))
    ratios = fork_ratios(result)
    if ratios:
        print(format_fork_ratios(ratios))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": [asdict(r) for r in result.runs],
                                              "machine": result.machine, "forked_over_exec": ratios},
                                             indent=2))
    missed = any(ratios.get(name, 0.0) > FORK_TARGET for name in ("per_added_replica_s", "rto_capacity_s"))
    return 1 if result.failed or missed else 0


@contextmanager
def _ray_cluster(address: str | None) -> Iterator[str]:
    """The Ray cluster to run on: the one given, or the lab, built here and always torn down."""
    if address is not None:
        yield address
        return
    lab = Lab()
    status = lab.up()
    print(f"lab up: {status.ray_address}, Ray's processes hold {status.rss_bytes / 2**20:.0f} MiB",
          flush=True)
    try:
        yield status.ray_address
    finally:
        lab.down()


def _one_run(backend: str, run: int, state: Path, ray_address: str) -> FleetRun:
    figures = FleetRun(backend, run)
    state.mkdir(parents=True, exist_ok=True)
    ensure_default_model(state / "state")  # built before any clock starts
    token = secrets.token_urlsafe(16)
    config, api = _write_config(state, backend, ray_address)
    launched = time.monotonic()
    process = _start(config, state / "up.log", token)
    try:
        with ControlPlaneClient(api, token) as client:
            _wait(lambda: _fleet(client, process, state), lambda v: v.ready_replicas >= 3)
            figures.up_to_3_ready_s = round(time.monotonic() - launched, 3)
            figures.spawn_to_3_ready_s = _spawn_to_ready(client, 3)
            asked = time.monotonic()
            client.scale(5)
            _wait(lambda: _fleet(client, process, state), lambda v: v.ready_replicas >= 5)
            figures.per_added_replica_s = round((time.monotonic() - asked) / 2, 3)
            client.scale(3)
            _wait(lambda: _fleet(client, process, state),
                  lambda v: len(v.replicas) == 3 and v.ready_replicas == 3)
            victim = sorted(r.replica_id for r in client.fleet().replicas)[0]
            client.chaos_inject("kill", replicas=[victim], duration_s=1.0)
            killed = time.monotonic()
            _wait(lambda: _fleet(client, process, state), lambda v: v.ready_replicas < 3, timeout=30)
            _wait(lambda: _fleet(client, process, state), lambda v: v.ready_replicas >= 3)
            figures.rto_capacity_s = round(time.monotonic() - killed, 3)
    except (ControlPlaneError, OSError, TimeoutError) as exc:
        figures.error = f"{type(exc).__name__}: {exc}"
    finally:
        stop_up(process)
    print(f"{backend} run {run}: {_row(figures)}", flush=True)
    return figures


def _write_config(state: Path, backend: str, ray_address: str) -> tuple[Path, str]:
    api_port = free_port()
    ray = f'ray_address = "{ray_address}"\n' if backend == "ray" else ""
    if backend == "local-exec":
        backend, ray = "local", "fork_replicas = false\n"
    config = state / "controlplane.toml"
    config.write_text(f"""state_dir = "{state / 'state'}"
[api]
port = {api_port}
[gateway]
port = {free_port()}
[fleet]
replicas = 3
base_port = {free_port() + 100}
backend = "{backend}"
{ray}[prometheus]
enabled = "off"
[autoscaler]
enabled = false
[alerts]
enabled = false
[console]
enabled = false
""")
    return config, f"http://127.0.0.1:{api_port}"


def _start(config: Path, log: Path, token: str) -> subprocess.Popen[bytes]:
    env = child_environment({"CONTROLPLANE_ADMIN_TOKEN": token})  # the one secret it needs, on purpose
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "controlplane", "up", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)


def stop_up(process: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Ctrl-C's way (SIGTERM: drain, then stop every replica), SIGKILL if that hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _fleet(client: ControlPlaneClient, process: subprocess.Popen[bytes], state: Path) -> FleetView | None:
    if process.poll() is not None:
        tail = (state / "up.log").read_text(errors="replace").strip().splitlines()[-1:]
        raise FleetBenchError(f"controlplane up exited with {process.returncode}: {' '.join(tail)}")
    try:
        return client.fleet()
    except (ControlPlaneError, OSError):
        return None  # not answering yet


def _wait(fetch: Callable[[], T | None], done: Callable[[T], bool], *, timeout: float = READY_TIMEOUT_S) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fetch()
        if value is not None and done(value):
            return value
        time.sleep(POLL_S)
    raise TimeoutError(f"the fleet did not get there within {timeout:g}s")


def _spawn_to_ready(client: ControlPlaneClient, n: int) -> float | None:
    spawned = client.events(kind="replica.spawned", limit=100)
    ready = client.events(kind="replica.ready", limit=100)
    if not spawned or len(ready) < n:
        return None
    return round(sorted(e.ts for e in ready)[n - 1] - min(e.ts for e in spawned), 3)


def _row(r: FleetRun) -> str:
    if r.error:
        return f"FAILED: {r.error}"
    return (f"up -> 3 ready {r.up_to_3_ready_s:.1f}s (fleet's share {r.spawn_to_3_ready_s}s), "
            f"per added replica {r.per_added_replica_s:.1f}s, "
            f"RTO_capacity after a kill {r.rto_capacity_s:.1f}s")


def format_fleet_report(result: FleetBenchResult) -> str:
    """One line per backend: the median of its runs for each figure."""
    lines = [f"fleet bench: {result.machine.get('cpus')} CPUs, Python {result.machine.get('python')}",
             f"{'backend':<10} {'runs':>4} {'up->3 ready s':>14} {'spawn->3 ready s':>17} "
             f"{'per added s':>12} {'RTO_capacity s':>15}"]
    for backend in dict.fromkeys(r.backend for r in result.runs):
        ok = [r for r in result.runs if r.backend == backend and r.error is None]
        lines.append(f"{backend:<10} {len(ok):>4} " + " ".join(
            f"{_median([getattr(r, name) for r in ok]):>{width}}" for name, width in (
                ("up_to_3_ready_s", 14), ("spawn_to_3_ready_s", 17), ("per_added_replica_s", 12),
                ("rto_capacity_s", 15))))
    lines += [f"FAILED {r.backend} run {r.run}: {r.error}" for r in result.failed]
    return "\n".join(lines)


def fork_ratios(result: FleetBenchResult) -> dict[str, float]:
    """Each figure's median for forked replicas (``local``) over exec'd ones (``local-exec``) of the same
    run; empty without both."""
    def medians(backend: str) -> dict[str, float]:
        ok = [r for r in result.runs if r.backend == backend and r.error is None]
        return {name: statistics.median(values) for name in FIGURES
                if (values := [v for r in ok if (v := getattr(r, name)) is not None])}

    forked, execd = medians("local"), medians("local-exec")
    return {name: round(forked[name] / execd[name], 3) for name in FIGURES
            if name in forked and execd.get(name, 0) > 0}


def format_fork_ratios(ratios: dict[str, float]) -> str:
    """One line: each figure forked over exec'd ("-" where either side did not measure it), and the
    verdict on the two a scale-up and a crash wait for."""
    def ratio(name: str) -> str:
        return f"{ratios[name]:.2f}" if name in ratios else "-"

    verdicts = ", ".join(f"{name} {'met' if ratios[name] <= FORK_TARGET else 'NOT MET'}"
                         for name in ("per_added_replica_s", "rto_capacity_s") if name in ratios)
    return (f"forked over exec'd (local / local-exec): up->3 ready {ratio('up_to_3_ready_s')}, spawn->3 "
            f"ready {ratio('spawn_to_3_ready_s')}, per added {ratio('per_added_replica_s')}, RTO_capacity "
            f"{ratio('rto_capacity_s')}; target <= {FORK_TARGET:g}: {verdicts or 'not measured'}")


def _median(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{statistics.median(present):.2f}" if present else "-"
