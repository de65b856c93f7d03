"""The host's CPU during a live run, by role: what ``python -m controlplane.bench sim-vs-live`` counts.

Where it sits: the live side of the sim-vs-live bench (:mod:`controlplane.bench.sim_vs_live`) samples
:class:`CpuMeter` while its load runs, and, before the slice, turns one probe's samples into
:class:`DataPathProbe`: the CPU the processes beside the replicas (the gateway, the load client, the
control plane) and the replicas' servers beside their engines spend per request, which the simulator then
takes from the host's cores (``SimSettings.host_cpu_per_request_s``).

The replicas' servers: a replica process runs its engine's steps and, beside them, the HTTP server that
parses requests, tokenizes and streams each token as a server-sent event. The profile prices the engine's
steps; what the server spends per request takes a core from the other replicas as the gateway's does
(7-9 ms a request on the default model, measured on 2026-12-07). It is the replica processes' CPU less
their engines' (:func:`engine_cpu_s`, from the replicas' own counters). A replica under a CPU limit pays
for its server within its quota, as it did while its profile was measured under the same limit.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inference.metrics import ENGINE_BUSY_SECONDS, ENGINE_STEP_CPU_SECONDS, ENGINE_TURN_SECONDS

BESIDE_REPLICAS = ("gateway", "load client", "control plane", "other processes of the run")
REPLICA_SERVERS = "replica servers"  # the replica processes' CPU beside their engines
ENGINE_COUNTERS = tuple(f"{name}_total" for name in (ENGINE_STEP_CPU_SECONDS, ENGINE_BUSY_SECONDS,
                                                     ENGINE_TURN_SECONDS))


def engine_counters(replica_urls: Iterable[str], timeout_s: float = 5.0) -> tuple[float, float, float]:
    """The replicas' engine counters summed, from their ``/metrics``: (CPU seconds within steps, busy
    seconds, of those the turns between steps)."""
    totals = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    with httpx.Client(timeout=timeout_s, trust_env=False) as http:
        for url in replica_urls:
            text = http.get(f"{url.rstrip('/')}/metrics").raise_for_status().text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in totals:
                        totals[sample.name] += sample.value
    step_cpu, busy, turn = (totals[name] for name in ENGINE_COUNTERS)
    return step_cpu, busy, turn


def engine_cpu_s(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """The engines' CPU seconds between two readings of :func:`engine_counters`: their steps' CPU, and
    their turns between steps (scheduling, in Python, which the profile's step times include) taken on a
    core at the steps' share."""
    step_cpu, busy, turn = (b - a for a, b in zip(before, after, strict=True))
    steps = busy - turn
    return step_cpu * busy / steps if steps > 0 else max(step_cpu, 0.0)


@dataclass(slots=True, frozen=True)
class DataPathProbe:
    """What the processes beside the replicas spent per request while the probe's requests ran: the
    simulator's ``host_cpu_per_request_s`` (``controlplane.sim.fleet``)."""

    requests: int
    seconds: float
    cpu: dict[str, float]  # core-seconds by role (CpuMeter.totals)
    # the replicas' engines' CPU seconds over the probe (engine_cpu_s); None: not read, the replicas'
    # servers are not counted
    engine_cpu_s: float | None = None
    # replicas under a CPU limit: their servers run within it, as they did while the profile was measured
    # under the same limit, so the host's cores do not pay for them (measured, not counted)
    servers_within_limit: bool = False

    @property
    def server_core_s(self) -> float:
        """The replica processes' CPU beside their engines."""
        if self.engine_cpu_s is None:
            return 0.0
        return max(self.cpu.get("replicas", 0.0) - self.engine_cpu_s, 0.0)

    @property
    def other_core_s(self) -> float:
        servers = 0.0 if self.servers_within_limit else self.server_core_s
        return sum(used for role, used in self.cpu.items() if role in BESIDE_REPLICAS) + servers

    @property
    def cpu_per_request_s(self) -> float:
        return self.other_core_s / self.requests if self.requests else 0.0

    def describe(self) -> str:
        by_role = {role: self.cpu[role] for role in BESIDE_REPLICAS if role in self.cpu}
        per_request = max(self.requests, 1)
        parts = ", ".join(f"{role} {used / per_request * 1e3:.1f}" for role, used in by_role.items())
        if self.engine_cpu_s is not None:
            parts += f", {REPLICA_SERVERS} {self.server_core_s / per_request * 1e3:.1f}" + (
                " (within the replicas' CPU limit: not counted)" if self.servers_within_limit else "")
        return (f"{self.requests} requests in {self.seconds:.0f}s, per request, ms of CPU: {parts}: "
                f"{self.cpu_per_request_s * 1e3:.1f} ms beside the replicas' engines")


class EngineMeter:
    """The replicas' engines' CPU seconds while the load runs (:func:`engine_cpu_s`), replica by replica:
    each from its counters when first seen (from zero for one that started after the load did) to when
    last read, so a replica stopped meanwhile counts up to its last reading."""

    def __init__(self, replica_urls: Iterable[str]) -> None:
        self.first: dict[str, tuple[float, float, float]] = {}
        self.last: dict[str, tuple[float, float, float]] = {}
        self.sample(replica_urls, baseline=True)

    def sample(self, replica_urls: Iterable[str], *, baseline: bool = False) -> None:
        for url in replica_urls:
            with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
                self.last[url] = engine_counters([url])
                self.first.setdefault(url, self.last[url] if baseline else (0.0, 0.0, 0.0))

    def engine_cpu_s(self) -> float:
        return sum(engine_cpu_s(self.first[url], last) for url, last in self.last.items())


class CpuMeter:
    """Core-seconds spent while the load runs: by the run's processes (the control plane and its
    descendants, whatever names the run's state folder, the load client), by role, and by the rest of the
    host. A process that ended between two samples is counted up to the sample before."""

    def __init__(self, control_plane: int, load: int, state: Path) -> None:
        self.cp, self.load, self.needle = control_plane, load, str(state).encode()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.host0, self.host, self.wall0, self.wall = self._host(), 0.0, time.monotonic(), 0.0
        self.sample(baseline=True)

    def _host(self) -> float:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + irq + softirq + steal) / self.tick

    def sample(self, *, baseline: bool = False) -> None:
        parents, used = {}, {}
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                rest = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                pid = int(proc.name)
                parents[pid], used[pid] = int(rest[1]), (int(rest[11]) + int(rest[12])) / self.tick
        for pid, cpu in used.items():
            role = self._role(pid, parents)
            if role is not None:
                self.first.setdefault(pid, cpu if baseline else 0.0)
                self.last[pid] = (role, cpu)
        self.host, self.wall = self._host() - self.host0, time.monotonic() - self.wall0

    def _role(self, pid: int, parents: dict[int, int]) -> str | None:
        if pid == self.load:
            return "load client"
        if pid == self.cp:
            return "control plane"
        ancestor, ours = parents.get(pid), False
        while ancestor and not ours:
            ours, ancestor = ancestor == self.cp, parents.get(ancestor)
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            ours = ours or self.needle in cmd or self.needle in Path(f"/proc/{pid}/environ").read_bytes()
            if ours and b"inference\0serve" in cmd:
                return "replicas"
            if ours:
                return "gateway" if b"controlplane.gateway" in cmd else "other processes of the run"
        return None

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, (role, used) in self.last.items():
            out[role] = out.get(role, 0.0) + used - self.first[pid]
        ours = sum(out.values())
        out["rest of the host"] = max(self.host - ours, 0.0)
        out["available"] = self.wall * (os.cpu_count() or 1)
        return {k: round(v, 1) for k, v in out.items()}
