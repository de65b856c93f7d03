"""A slice of a trace through a live ``controlplane up``: the live side of ``python -m controlplane.bench
sim-vs-live`` (:mod:`controlplane.bench.sim_vs_live`).

:func:`write_config` writes the control plane's configuration, ``[autoscaler]`` field by field from the
simulator's own (read back to check that the two are the same), the gateway routing and queueing as the
simulator's does. :func:`run_live` starts it (its own state folder, free loopback ports, the built default
model linked in, Prometheus, alerts and console off), waits for its first replica, runs the probe of the
CPU beside the replicas (:func:`run_probe`), replays the slice with the load client (``python -m
inference.bench serve``), reads the fleet every second and counts the run's CPU, then collects the
autoscaler's decision records and the replicas' starts (:class:`LiveRun`), and stops it leaving no process
(:func:`leftover_pids`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from controlplane.autoscale.config import AutoscalerConfig
from controlplane.bench.host_cpu import CpuMeter, DataPathProbe, EngineMeter, engine_counters, engine_cpu_s
from controlplane.bench.live_speed import host_speed, run_drift, run_share
from controlplane.bench.sim_vs_live_report import (
    replica_starts,
)
from controlplane.client import ControlPlaneClient, Decision
from controlplane.config import load_config
from controlplane.errors import ControlPlaneError
from controlplane.sim.trace import TraceShape
from controlplane.telemetry.base import DEFAULT_WINDOW_S
from inference.bench.datasets import AZURE_TRACE
from inference.bench.report import RequestRecord, read_jsonl
from inference.environment import child_environment
from inference.launcher import free_port
from inference.models.default import ensure_default_model

ALIVE = frozenset({"starting", "ready", "draining", "ejected"})  # replicas paid for (fleet.py's "alive")
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
ENGINE_READ_EVERY = 5  # of the 1 s fleet readings while the load runs, one in this many reads the engines
LOAD_GRACE_S = 120.0  # after the last arrival, for requests in flight to finish
# The gateway as the simulator models it (``controlplane.sim.fleet``): least-request routing, no admission
# control, no giving up on a queued request. With its defaults it sheds load (a shed request never reaches
# a replica's telemetry, so the autoscaler does not see it) and takes a request waiting 2 s in a replica's
# queue for a stall (503 after its retries), neither of which the simulator has. The replicas' own queue
# bound (128 requests) still holds.
GATEWAY_AS_SIMULATED = {"routing": "least-request", "max_inflight_per_replica": 1_000_000,
                        "stall_timeout_s": LOAD_GRACE_S, "first_byte_timeout_s": LOAD_GRACE_S}


class SimVsLiveError(ControlPlaneError, RuntimeError):
    """The comparison could not be set up (the control plane did not start, the load client failed)."""


@dataclass(slots=True, frozen=True)
class Slice:
    trace_start_s: float
    duration_s: float  # of replay
    compress: float
    token_scale: float
    max_prompt_len: int
    max_output_len: int

    def shape(self) -> TraceShape:
        return TraceShape(compress=self.compress, token_scale=self.token_scale, start_s=self.trace_start_s,
                          duration_s=self.duration_s * self.compress, max_prompt_len=self.max_prompt_len,
                          max_output_len=self.max_output_len)


# ---- the configuration both sides run ----------------------------------------------------------
def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | list):
        return json.dumps(value)
    raise TypeError(f"no TOML form for {value!r}")


def autoscaler_table(config: AutoscalerConfig) -> str:
    """``[autoscaler]`` with every field of ``config`` that differs from the defaults (and ``enabled``)."""
    defaults = AutoscalerConfig()
    lines = ["[autoscaler]", "enabled = true"]
    for f in dataclasses.fields(AutoscalerConfig):
        value = getattr(config, f.name)
        if f.name not in ("enabled", "windows") and value != getattr(defaults, f.name):
            lines.append(f"{f.name} = {toml_value(value)}")
    if config.windows:
        raise ValueError("sim-vs-live: schedule windows are not compared")
    return "\n".join(lines) + "\n"


def write_config(workdir: Path, autoscaler: AutoscalerConfig, *, observe_only: bool = False,
                 cpu_limit: float | None = None) -> tuple[Path, str, str]:
    """The live run's TOML (free loopback ports, 1 replica, the simulator's autoscaler, observing only
    until the probe is done when ``observe_only``, replicas under the CPU limit the profile was measured
    under): (path, API URL, gateway URL). The file is read back as ``controlplane up`` reads it: its
    autoscaler must be the one given."""
    autoscaler = dataclasses.replace(autoscaler, observe_only=observe_only)
    api, gateway = free_port(), free_port()
    config = workdir / "controlplane.toml"
    config.write_text(f'state_dir = "{workdir / "state"}"\n[api]\nport = {api}\n[gateway]\nport = {gateway}\n'
                      + "".join(f"{k} = {toml_value(v)}\n" for k, v in GATEWAY_AS_SIMULATED.items())
                      + f"[fleet]\nreplicas = 1\nbase_port = {free_port() + 100}\n"
                      + ("" if cpu_limit is None else f"replica_cpu_limit = {cpu_limit!r}\n")
                      + '[prometheus]\nenabled = "off"\n'
                      + "[alerts]\nenabled = false\n[console]\nenabled = false\n"
                      + autoscaler_table(autoscaler))
    loaded = load_config(config)
    if loaded.autoscaler != autoscaler:
        raise SimVsLiveError(f"the live autoscaler config is not the simulator's:\n{loaded.autoscaler}\n"
                             f"{autoscaler}")
    if loaded.fleet.replica_cpu_limit != cpu_limit:
        raise SimVsLiveError(f"the live replicas' CPU limit {loaded.fleet.replica_cpu_limit} is not the "
                             f"profile's {cpu_limit}")
    return config, f"http://127.0.0.1:{api}", f"http://127.0.0.1:{gateway}"



# ---- the live run -------------------------------------------------------------------------------
@contextlib.contextmanager
def control_plane(config: Path, workdir: Path, token: str) -> Iterator[subprocess.Popen[bytes]]:
    """``controlplane up`` in its own session; stopped with SIGINT (it drains), SIGKILL if that hangs,
    then whatever process of its state folder survived is killed too."""
    with (workdir / "up.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "controlplane", "up", "--config", str(config)],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=child_environment({"CONTROLPLANE_ADMIN_TOKEN": token,
                                                          "PYTHONUNBUFFERED": "1"}))
    try:
        yield process
    finally:
        stop(process, workdir / "state")


def stop(process: subprocess.Popen[bytes], state: Path) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for pid in leftover_pids(state):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def leftover_pids(state: Path) -> list[int]:
    """Processes of this run's state folder (in their command line or environment): none after a stop."""
    needle, pids = str(state).encode(), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes() or needle in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def wait_ready(process: subprocess.Popen[bytes], client: ControlPlaneClient, gateway: str, log: Path) -> None:
    """1 replica ready at the control plane and routable at the gateway."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise SimVsLiveError(f"controlplane up exited with {process.returncode}:\n{tail}")
        with contextlib.suppress(ControlPlaneError, httpx.HTTPError, OSError, KeyError, ValueError):
            health = httpx.get(f"{gateway}/health", timeout=5, trust_env=False).json()
            if client.fleet().ready_replicas >= 1 and len(health["routable"]) >= 1:
                return
        time.sleep(0.5)
    raise SimVsLiveError(f"no replica ready and routable within {START_TIMEOUT_S:g}s; see {log}")


def load_command(cut: Slice, gateway: str, workdir: Path, *, name: str = "load", seed: int = 0) -> list[str]:
    """The load client replaying the slice; ``--token-ids`` times tokens as they stream, the simulator's
    terms: the bundled model's tokens often carry no text yet (a byte of a character), and timed by its
    text a stream's first token reached the client up to 3.7 s after the gateway had it (the 300 s run of
    2026-12-04, at 0.15 s per token). ``seed`` draws the prompts' tokens: the probe's differ from the
    slice's, so that the replicas' prefix caches do not hold the slice's prompts when it starts."""
    return [sys.executable, "-m", "inference.bench", "serve", "--base-url", gateway,
            "--dataset", f"trace:{AZURE_TRACE}", "--time-scale", repr(cut.compress),
            "--token-scale", repr(cut.token_scale), "--trace-start", repr(cut.trace_start_s),
            "--trace-duration", repr(cut.duration_s * cut.compress),
            "--max-input-len", str(cut.max_prompt_len), "--max-output-len", str(cut.max_output_len),
            "--duration", f"{cut.duration_s + 5:g}", "--grace", f"{LOAD_GRACE_S:g}",
            "--request-timeout", f"{LOAD_GRACE_S:g}", "--seed", str(seed),
            "--jsonl", str(workdir / f"{name}.jsonl"), "--result-json", str(workdir / f"{name}.json"),
            "--no-progress", "--token-ids"]


@dataclass(slots=True)
class LiveRun:
    records: list[RequestRecord]
    fleet: list[tuple[float, int]]  # (POSIX seconds, replicas paid for)
    decisions: list[tuple[float, bool, str]]  # (POSIX seconds, applied, outcome)
    cpu: dict[str, float] = field(default_factory=dict)  # core-seconds during the load, by role
    drift: float | None = None  # the replicas' engine time over the profile's, across the run's decisions
    on_cpu: float | None = None  # the share of the replicas' step time on a core, across the decisions
    speed: list[tuple[float, float]] = field(default_factory=list)  # (POSIX s, host speed): host_speed
    probe: DataPathProbe | None = None  # the host's other CPU per request, measured before the slice
    cut: Slice | None = None  # the slice replayed
    ticks: list[Decision] = field(default_factory=list)  # every decision record, the probe's included
    starts: list[float] = field(default_factory=list)  # scale-up to each new replica ready (replica_starts)
    engine_cpu_s: float | None = None  # the replicas' engines' CPU seconds while the load ran (EngineMeter)
    waiting_core: float | None = None  # the share of the replicas' step time waiting for a core

    def server_cpu_per_request_s(self) -> float | None:
        """The replica processes' CPU beside their engines while the load ran, per request (the probe
        measures the same before the slice)."""
        if self.engine_cpu_s is None or "replicas" not in self.cpu or not self.records:
            return None
        return max(self.cpu["replicas"] - self.engine_cpu_s, 0.0) / len(self.records)


def run_live(cut: Slice, autoscaler: AutoscalerConfig, workdir: Path, source_state: Path,
             probe_s: float = 0.0, cpu_limit: float | None = None,
             choose: Callable[[DataPathProbe | None], Slice] | None = None) -> LiveRun:
    """The slice through a live ``controlplane up``. ``choose``: the slice to replay once the probe (of
    ``cut``'s start) has measured the CPU beside the replicas (None: ``cut``)."""
    models = ensure_default_model(source_state).parent  # built before the control plane starts
    (workdir / "state").mkdir(parents=True, exist_ok=True)
    (workdir / "state" / "models").symlink_to(models, target_is_directory=True)
    config, api, gateway = write_config(workdir, autoscaler, observe_only=probe_s > 0, cpu_limit=cpu_limit)
    token = secrets.token_urlsafe(16)
    with control_plane(config, workdir, token) as process, ControlPlaneClient(api, token) as client:
        wait_ready(process, client, gateway, workdir / "up.log")
        probe = None
        if probe_s > 0:
            probe = run_probe(cut, probe_s, gateway, workdir, process.pid,
                              replicas=[r.url for r in client.fleet().replicas if r.state == "ready"],
                              within_limit=cpu_limit is not None)
            print(f"live: probe of the data path's CPU: {probe.describe()}", flush=True)
            quiet = (autoscaler.metrics_window_s or DEFAULT_WINDOW_S) + autoscaler.tick_s
            time.sleep(quiet)  # the probe's requests leave the autoscaler's window before it may act
            client.autoscaler_configure(observe_only=False)
        cut = cut if choose is None else choose(probe)
        started = time.time()
        print(f"live: 1 replica ready; replaying the slice for {cut.duration_s:g}s", flush=True)
        fleet: list[tuple[float, int]] = []
        with (workdir / "load.log").open("wb") as log:
            load = subprocess.Popen(load_command(cut, gateway, workdir), stdout=log, stderr=subprocess.STDOUT,
                                    env=child_environment())
        meter = CpuMeter(process.pid, load.pid, workdir / "state")
        urls = [r.url for r in client.fleet().replicas if r.state in ALIVE]
        engines, reads = EngineMeter(urls), itertools.count(1)
        try:
            while load.poll() is None:
                with contextlib.suppress(ControlPlaneError, httpx.HTTPError, OSError):
                    view = client.fleet()
                    fleet.append((time.time(), sum(r.state in ALIVE for r in view.replicas)))
                    urls = [r.url for r in view.replicas if r.state in ALIVE]
                meter.sample()
                if next(reads) % ENGINE_READ_EVERY == 0:
                    engines.sample(urls)
                time.sleep(max(0.0, 1.0 - time.time() % 1.0))
            engines.sample(urls)
        finally:
            if load.poll() is None:
                load.kill()
                load.wait()
        if load.returncode != 0:
            raise SimVsLiveError(f"the load client exited with {load.returncode}; see {workdir / 'load.log'}")
        ticks = client.autoscaler_decisions(limit=5000)
        starts = replica_starts(client.events(limit=1000), started)
    records = [d for d in ticks if d.at >= started]
    decisions = [(d.at, d.applied, d.outcome) for d in records]
    window = autoscaler.metrics_window_s or DEFAULT_WINDOW_S
    return LiveRun(read_jsonl(workdir / "load.jsonl"), fleet, decisions, meter.totals(), run_drift(records),
                   run_share(records, "on_cpu"),
                   host_speed(records, window_s=window, cores=os.cpu_count() or 1), probe, cut, ticks, starts,
                   engines.engine_cpu_s(), run_share(records, "waiting_core"))


def run_probe(cut: Slice, probe_s: float, gateway: str, workdir: Path, control_plane: int, *,
              replicas: list[str] | None = None, within_limit: bool = False) -> DataPathProbe:
    """The slice's first ``probe_s`` seconds through the gateway (prompts of another seed), the autoscaler
    observing only: the CPU the gateway, the load client, the control plane and the servers of the
    ``replicas`` (their URLs; their engines' CPU from their counters is left out) spend per request, which
    the simulator then takes from the host's cores. Measured before the slice, as the profile is.
    ``within_limit``: the replicas run under a CPU limit, which their servers' CPU comes out of (reported,
    not counted)."""
    probe = dataclasses.replace(cut, duration_s=probe_s)
    engines = engine_counters(replicas) if replicas else None
    with (workdir / "probe.log").open("wb") as log:
        load = subprocess.Popen(load_command(probe, gateway, workdir, name="probe", seed=1), stdout=log,
                                stderr=subprocess.STDOUT, env=child_environment())
    meter = CpuMeter(control_plane, load.pid, workdir / "state")
    started = time.monotonic()
    try:
        while load.poll() is None:
            meter.sample()
            time.sleep(0.5)
        meter.sample()
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
    if load.returncode != 0:
        raise SimVsLiveError(f"the probe's load client exited with {load.returncode}; "
                             f"see {workdir / 'probe.log'}")
    done = [r for r in read_jsonl(workdir / "probe.jsonl") if r.is_success]
    if not done:
        raise SimVsLiveError(f"no probe request succeeded; see {workdir / 'probe.log'}")
    engine_cpu = None if engines is None or not replicas else engine_cpu_s(engines, engine_counters(replicas))
    return DataPathProbe(len(done), time.monotonic() - started, meter.totals(), engine_cpu, within_limit)
