"""The host's CPU during a live run, by role: what ``python -m controlplane.bench sim-vs-live`` counts.

Where it sits: the live side of the sim-vs-live bench (:mod:`controlplane.bench.sim_vs_live`) samples
:class:`CpuMeter` while its load runs, and, before the slice, turns one probe's samples into
:class:`DataPathProbe`: the CPU the processes beside the replicas (the gateway, the load client, the
control plane) spend per request, which the simulator then takes from the host's cores
(``SimSettings.host_cpu_per_request_s``).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

BESIDE_REPLICAS = ("gateway", "load client", "control plane", "other processes of the run")


@dataclass(slots=True, frozen=True)
class DataPathProbe:
    """What the processes beside the replicas spent per request while the probe's requests ran: the
    simulator's ``host_cpu_per_request_s`` (``controlplane.sim.fleet``)."""

    requests: int
    seconds: float
    cpu: dict[str, float]  # core-seconds by role (CpuMeter.totals)

    @property
    def other_core_s(self) -> float:
        return sum(used for role, used in self.cpu.items() if role in BESIDE_REPLICAS)

    @property
    def cpu_per_request_s(self) -> float:
        return self.other_core_s / self.requests if self.requests else 0.0

    def describe(self) -> str:
        parts = ", ".join(f"{role} {self.cpu.get(role, 0.0) / max(self.requests, 1) * 1e3:.1f}"
                          for role in BESIDE_REPLICAS if role in self.cpu)
        return (f"{self.requests} requests in {self.seconds:.0f}s, per request, ms of CPU: {parts}: "
                f"{self.cpu_per_request_s * 1e3:.1f} ms beside the replicas")


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
