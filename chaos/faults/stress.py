"""The ``stress`` fault kind: CPU and memory pressure next to a replica, on the CPUs it runs on.

Backend: ``stress-ng`` when it is installed (``--cpu N --cpu-load L`` and ``--vm 1 --vm-bytes B
--vm-keep``, pinned with ``--taskset`` to the replica's CPU affinity, ``--timeout`` = the fault's duration
plus a grace as a second safety net), else a bounded Python burner subprocess (a CPU loop at the same duty
cycle and a touched ``bytearray``) that exits by itself at the same deadline.

Limits, relative to the host (:class:`HostResources`): all stress faults together, the running ones and
the ones planned, hold at most half the host's memory and run at most one CPU worker per CPU; the fault
manager asks :meth:`StressFault.over_budget` before anything starts (and counts stressed replicas against
the blast radius, see ``FaultKindInfo.impairs``). The control plane is never the target: its own process is
refused, CPUs it is pinned to are left out of the stressor's set, and the stressor's workers are the OOM
killer's first choice (``oom_score_adj`` 1000; stress-ng's ``--oomable`` keeps a killed one from coming
back).

The stressor runs in its own session, so its process group id is its pid. Every process of it carries a
tag in its environment (``CHAOS_STRESS_TAG``), chosen in ``prepare`` and so already in the ledger before
anything starts. Revert kills the group when the leader's pid still has the recorded start time (read with
psutil; a recycled pid is never signalled), then any process that carries the tag (an orphaned worker); a
new control plane can do the same after a crash from the token alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import psutil

from chaos.faults.base import (
    Fault,
    FaultError,
    FaultKindInfo,
    FaultSpec,
    ParamInfo,
    RevertFailed,
    RevertToken,
    Scalar,
    check_params,
)
from chaos.faults.process import process_start_time, process_state, start_ticks
from chaos.targets import Target
from inference.environment import child_environment

logger = logging.getLogger(__name__)

KIND = "stress"
TAG_ENV = "CHAOS_STRESS_TAG"
TIMEOUT_GRACE_S = 5  # the stressor's own deadline is a little after the fault's, revert comes first
MEMORY_SHARE = 0.5  # all stress faults together hold at most this share of the host's memory
WORKERS_PER_CPU = 1  # ... and run at most this many CPU workers per CPU of the host
REAP_TIMEOUT_S = 2.0
Backend = Literal["stress-ng", "python"]

# The fallback stressor: argv = workers, load percent, vm bytes, seconds, comma-separated CPUs.
BURNER = r"""
import os, sys, time
try:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # the OOM killer's first choice, as stress-ng makes its workers
except OSError:
    pass
workers, load, vm_bytes, seconds = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
cpus = {int(c) for c in sys.argv[5].split(",") if c}
if cpus:
    os.sched_setaffinity(0, cpus)
deadline = time.monotonic() + seconds
is_leader = True
for _ in range(max(workers - 1, 0)):
    if os.fork() == 0:
        is_leader = False
        break
buf = bytearray(vm_bytes) if is_leader and vm_bytes else None
busy = load / 100.0 * 0.1
while time.monotonic() < deadline:
    if buf is not None:
        for i in range(0, len(buf), 4096):
            buf[i] = (buf[i] + 1) & 0xFF
    if workers <= 0:
        time.sleep(0.1)
        continue
    start = time.monotonic()
    while time.monotonic() - start < busy:
        pass
    time.sleep(max(0.1 - busy, 0.0))
"""


@dataclass(slots=True, frozen=True)
class HostResources:
    """What the stress limits are relative to: the host's memory and CPUs."""

    memory_bytes: int
    num_cpus: int

    def __post_init__(self) -> None:
        if self.memory_bytes < 1 or self.num_cpus < 1:
            raise ValueError(f"host resources: need memory and CPUs, got {self!r}")

    @classmethod
    def detect(cls) -> HostResources:
        return cls(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), os.cpu_count() or 1)

    @property
    def max_vm_bytes(self) -> int:
        return int(self.memory_bytes * MEMORY_SHARE)

    @property
    def max_cpu_workers(self) -> int:
        return self.num_cpus * WORKERS_PER_CPU


class StressFault(Fault):
    """``backend`` is ``auto`` (stress-ng when found), ``stress-ng`` or ``python``."""

    expires_by_itself = True

    def __init__(self, *, backend: str = "auto", stress_ng: str | None = None,
                 host: HostResources | None = None) -> None:
        if backend not in ("auto", "stress-ng", "python"):
            raise ValueError(f"backend: must be auto, stress-ng or python, got {backend!r}")
        self._stress_ng = stress_ng or shutil.which("stress-ng")
        self._backend: Backend = "stress-ng" if backend != "python" and self._stress_ng else "python"
        self._missing = backend == "stress-ng" and not self._stress_ng
        self._tags: dict[tuple[int, str], str] = {}  # prepare -> inject hand-over of the ledger's tag
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # to reap after revert
        self._host = host or HostResources.detect()
        self._load: dict[str, tuple[int, int]] = {}  # tag -> (CPU workers, vm bytes) of a running stressor

    @property
    def backend(self) -> Backend:
        return self._backend

    def describe(self) -> FaultKindInfo:
        backend = f"stress-ng at {self._stress_ng}" if self._backend == "stress-ng" else \
            "a bounded Python burner (stress-ng not found)"
        return FaultKindInfo(
            kind=KIND, family="resource", available=not self._missing,
            unavailable_reason="unavailable: stress-ng not found" if self._missing else None,
            description=f"CPU and memory pressure on the replica's CPUs; backend: {backend}; all stress "
                        f"faults together at most {self._host.max_cpu_workers} CPU workers and "
                        f"{self._host.max_vm_bytes} bytes (half the host's memory)",
            impairs=True,
            params=(ParamInfo("cpu_workers", "integer", "CPU stressor processes", required=False, default=1),
                    ParamInfo("cpu_load", "number", "percent busy per CPU worker (1-100)", required=False,
                              default=100),
                    ParamInfo("vm_bytes", "integer", "bytes of memory to hold and touch (0: none)",
                              required=False, default=0)))

    def validate(self, spec: FaultSpec) -> None:
        if spec.kind != KIND:
            raise ValueError(f"kind: expected {KIND!r}, got {spec.kind!r}")
        params = check_params(spec, self.describe())
        workers, load = _num(params["cpu_workers"]), _num(params["cpu_load"])
        vm_bytes = _num(params["vm_bytes"])
        max_workers, max_bytes = self._host.max_cpu_workers, self._host.max_vm_bytes
        if not 0 <= workers <= max_workers:
            raise ValueError(f"params.cpu_workers: must be 0..{max_workers} (the host's CPUs), "
                             f"got {workers:g}")
        if not 1 <= load <= 100:
            raise ValueError(f"params.cpu_load: must be 1..100 percent, got {load:g}")
        if not 0 <= vm_bytes <= max_bytes:
            raise ValueError(f"params.vm_bytes: must be 0..{max_bytes} (half the host's memory), got "
                             f"{vm_bytes:g}")
        if workers == 0 and vm_bytes == 0:
            raise ValueError("params: nothing to stress (cpu_workers and vm_bytes are both 0)")

    def over_budget(self, spec: FaultSpec, targets: Sequence[Target]) -> str | None:
        """Why stressing ``targets`` now would exceed the host's limits, counting the stressors already
        running; None when it fits."""
        params = check_params(spec, self.describe())
        workers, vm_bytes = int(_num(params["cpu_workers"])), int(_num(params["vm_bytes"]))
        return self._over_budget(workers * len(targets), vm_bytes * len(targets), len(targets))

    def _over_budget(self, workers: int, vm_bytes: int, num_targets: int) -> str | None:
        running_workers = sum(w for w, _ in self._load.values())
        running_bytes = sum(b for _, b in self._load.values())
        host, running = self._host, f"{len(self._load)} stressors running"
        if running_workers + workers > host.max_cpu_workers:
            return (f"stress budget: {workers} CPU workers on {num_targets} targets plus {running_workers} "
                    f"({running}) exceed the host's {host.max_cpu_workers} CPUs")
        if running_bytes + vm_bytes > host.max_vm_bytes:
            return (f"stress budget: {vm_bytes} bytes on {num_targets} targets plus {running_bytes} "
                    f"({running}) exceed half the host's memory ({host.max_vm_bytes} bytes)")
        return None

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        self._checked_pid(target)
        tag = uuid.uuid4().hex
        self._tags[(id(spec), target.replica_id)] = tag
        return RevertToken(KIND, target.replica_id, "kill_stressor", {"tag": tag, "backend": self._backend})

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        self.validate(spec)
        pid = self._checked_pid(target)
        tag = self._tags.pop((id(spec), target.replica_id), None) or uuid.uuid4().hex
        cpus = self._cpus(target, pid)
        params = check_params(spec, self.describe())
        load = int(_num(params["cpu_workers"])), int(_num(params["vm_bytes"]))
        problem = self._over_budget(*load, 1)  # a concurrent plan may have taken the room since
        if problem is not None:
            raise FaultError(f"{target.replica_id}: {problem}")
        argv = self._argv(params, cpus, spec.duration_s)
        try:
            child = subprocess.Popen(argv, env=child_environment({TAG_ENV: tag}), start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        except OSError as exc:
            raise FaultError(f"{target.replica_id}: cannot start {argv[0]}: {exc}") from exc
        # The stressor pins itself too, but only once it has started: until then it would run on our CPUs.
        # OSError: it exited already (its own error is in its exit status).
        with contextlib.suppress(OSError):
            os.sched_setaffinity(child.pid, cpus)
        started = process_start_time(child.pid)
        self._children[child.pid] = child
        self._load[tag] = load
        logger.warning("%s: %s stressor pid %d on CPUs %s (%s)", target.replica_id, self._backend, child.pid,
                       cpus, " ".join(argv[1:]) if self._backend == "stress-ng" else "python burner")
        data: dict[str, Scalar] = {"tag": tag, "backend": self._backend, "pid": child.pid,
                                   "start_time": started, "cpus": ",".join(map(str, cpus))}
        return RevertToken(KIND, target.replica_id, "kill_stressor", data)

    async def revert(self, token: RevertToken) -> None:
        if token.action != "kill_stressor" or not isinstance(token.data.get("tag"), str):
            raise RevertFailed(f"{token.target}: malformed stress token {token.to_json()!r}", retryable=False)
        await asyncio.to_thread(self._kill, token)

    def _kill(self, token: RevertToken) -> None:
        tag, pid, started = str(token.data["tag"]), token.data.get("pid"), token.data.get("start_time")
        is_ours = isinstance(pid, int) and isinstance(started, int) \
            and process_start_time(pid) == started
        if is_ours and isinstance(pid, int):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # its own session: the group id is the leader's pid
        for stray in self._strays(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(stray, signal.SIGKILL)
        child = self._children.pop(pid, None) if isinstance(pid, int) else None
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(REAP_TIMEOUT_S)
        # SIGKILL takes effect when each worker next runs and frees its memory: give them a moment.
        deadline = time.monotonic() + REAP_TIMEOUT_S
        while left := [p for p in self._strays(token) if _is_alive(p)]:
            if time.monotonic() > deadline:
                raise RevertFailed(f"{token.target}: stressor processes {left} still running", retryable=True)
            time.sleep(0.05)
        self._load.pop(tag, None)
        logger.info("%s: stressor (tag %s) killed", token.target, tag[:8])

    def _strays(self, token: RevertToken) -> list[int]:
        """What is left of the stressor: processes with its tag, and (stress-ng workers overwrite their
        environment with their title) members of its process group started no earlier than its leader."""
        found = set(tagged_pids(str(token.data["tag"])))
        pgid, started = token.data.get("pid"), token.data.get("start_time")
        # The kernel gives out no pid that a live process group still has as its id: when the leader's
        # pid runs another process now, the stressor's group is gone and that group is someone else's
        # (a replica or a guard started in its own session, with a name that passes the filter below).
        leader = process_start_time(pgid) if isinstance(pgid, int) else None
        if isinstance(pgid, int) and isinstance(started, int) and leader in (None, started):
            prefix = "stress-ng" if token.data.get("backend") == "stress-ng" else "python"
            found |= set(group_pids(pgid, since=started, comm_prefix=prefix))
        return sorted(found)

    def _argv(self, params: dict[str, Scalar], cpus: Sequence[int], duration_s: float) -> list[str]:
        workers, load, vm_bytes = int(_num(params["cpu_workers"])), _num(params["cpu_load"]), \
            int(_num(params["vm_bytes"]))
        seconds = math.ceil(duration_s) + TIMEOUT_GRACE_S
        if self._backend == "python":
            return [sys.executable, "-c", BURNER, str(workers), f"{load:g}", str(vm_bytes), str(seconds),
                    ",".join(map(str, cpus))]
        argv = [str(self._stress_ng), "--taskset", ",".join(map(str, cpus)), "--timeout", f"{seconds}s",
                "--quiet", "--oomable"]
        if workers:
            argv += ["--cpu", str(workers), "--cpu-load", f"{load:g}"]
        if vm_bytes:
            argv += ["--vm", "1", "--vm-bytes", str(vm_bytes), "--vm-keep"]
        return argv

    def _checked_pid(self, target: Target) -> int:
        pid = target.pid
        if pid is None or pid <= 1 or process_start_time(pid) is None:
            raise FaultError(f"{target.replica_id}: no local process to stress next to (pid {pid!r})")
        if pid == os.getpid():
            raise FaultError(f"{target.replica_id}: pid {pid} is the control plane's own process; "
                             "it is never stressed")
        return pid

    def _cpus(self, target: Target, pid: int) -> list[int]:
        """The target's CPUs, less those the control plane is pinned to when the target has others."""
        try:
            theirs = os.sched_getaffinity(pid)
        except OSError as exc:
            msg = f"{target.replica_id}: cannot read the CPU affinity of pid {pid}: {exc}"
            raise FaultError(msg) from exc
        return sorted((theirs - os.sched_getaffinity(0)) or theirs)


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries ``CHAOS_STRESS_TAG=<tag>`` (a pid reused by others never does);
    processes whose environment is not ours to read are not ours."""
    return sorted(p.info["pid"] for p in psutil.process_iter(["pid", "environ"])
                  if (p.info["environ"] or {}).get(TAG_ENV) == tag)


def group_pids(pgid: int, *, since: int, comm_prefix: str) -> list[int]:
    """Members of process group ``pgid`` started at or after ``since`` (clock ticks since boot) whose name
    starts with the prefix."""
    found = []
    for p in psutil.process_iter(["pid", "name", "create_time"]):
        name, created = p.info["name"] or "", p.info["create_time"]
        if created is None or not name.startswith(comm_prefix) or start_ticks(created) < since:
            continue
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(p.info["pid"]) == pgid:
                found.append(p.info["pid"])
    return sorted(found)


def _is_alive(pid: int) -> bool:
    """Running, or stopped: not gone and not a zombie that waits to be reaped."""
    return process_state(pid) not in (None, psutil.STATUS_ZOMBIE)


def _num(value: Scalar) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def faults() -> list[Fault]:
    """The catalogue's hook for optional fault modules."""
    return [StressFault()]
