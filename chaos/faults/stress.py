"""The ``stress`` fault kind: CPU and memory pressure next to a replica, on the CPUs it runs on.

Backend: ``stress-ng`` when it is installed (``--cpu N --cpu-load L`` and ``--vm 1 --vm-bytes B
--vm-keep``, pinned with ``--taskset`` to the replica's CPU affinity, ``--timeout`` = the fault's duration
plus a grace as a second safety net), else a bounded Python burner subprocess (a CPU loop at the same duty
cycle and a touched ``bytearray``) that exits by itself at the same deadline.

The stressor runs in its own session, so its process group id is its pid. Every process of it carries a
tag in its environment (``CHAOS_STRESS_TAG``), chosen in ``prepare`` and so already in the ledger before
anything starts. Revert kills the group when the leader's pid still has the recorded start time (from
``/proc/<pid>/stat``; a recycled pid is never signalled), then any process that carries the tag (an
orphaned worker); a new control plane can do the same after a crash from the token alone.
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

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
from chaos.faults.process import PROC, process_start_time
from chaos.targets import Target

logger = logging.getLogger(__name__)

KIND = "stress"
TAG_ENV = "CHAOS_STRESS_TAG"
TIMEOUT_GRACE_S = 5  # the stressor's own deadline is a little after the fault's, revert comes first
MAX_CPU_WORKERS = 64
MAX_VM_BYTES = 64 * 2**30
REAP_TIMEOUT_S = 2.0
Backend = Literal["stress-ng", "python"]

# The fallback stressor: argv = workers, load percent, vm bytes, seconds, comma-separated CPUs.
BURNER = r"""
import os, sys, time
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


class StressFault(Fault):
    """``backend`` is ``auto`` (stress-ng when found), ``stress-ng`` or ``python``."""

    def __init__(self, *, backend: str = "auto", stress_ng: str | None = None, proc: Path = PROC) -> None:
        if backend not in ("auto", "stress-ng", "python"):
            raise ValueError(f"backend: must be auto, stress-ng or python, got {backend!r}")
        self._stress_ng = stress_ng or shutil.which("stress-ng")
        self._backend: Backend = "stress-ng" if backend != "python" and self._stress_ng else "python"
        self._missing = backend == "stress-ng" and not self._stress_ng
        self._proc = proc
        self._tags: dict[tuple[int, str], str] = {}  # prepare -> inject hand-over of the ledger's tag
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # to reap after revert

    @property
    def backend(self) -> Backend:
        return self._backend

    def describe(self) -> FaultKindInfo:
        backend = f"stress-ng at {self._stress_ng}" if self._backend == "stress-ng" else \
            "a bounded Python burner (stress-ng not found)"
        return FaultKindInfo(
            kind=KIND, family="resource", available=not self._missing,
            unavailable_reason="unavailable: stress-ng not found" if self._missing else None,
            description=f"CPU and memory pressure on the replica's CPUs; backend: {backend}",
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
        if not 0 <= workers <= MAX_CPU_WORKERS:
            raise ValueError(f"params.cpu_workers: must be 0..{MAX_CPU_WORKERS}, got {workers:g}")
        if not 1 <= load <= 100:
            raise ValueError(f"params.cpu_load: must be 1..100 percent, got {load:g}")
        if not 0 <= vm_bytes <= MAX_VM_BYTES:
            raise ValueError(f"params.vm_bytes: must be 0..{MAX_VM_BYTES}, got {vm_bytes:g}")
        if workers == 0 and vm_bytes == 0:
            raise ValueError("params: nothing to stress (cpu_workers and vm_bytes are both 0)")

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        self._checked_pid(target)
        tag = uuid.uuid4().hex
        self._tags[(id(spec), target.replica_id)] = tag
        return RevertToken(KIND, target.replica_id, "kill_stressor", {"tag": tag, "backend": self._backend})

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        self.validate(spec)
        pid = self._checked_pid(target)
        tag = self._tags.pop((id(spec), target.replica_id), None) or uuid.uuid4().hex
        try:
            cpus = sorted(os.sched_getaffinity(pid))
        except OSError as exc:
            msg = f"{target.replica_id}: cannot read the CPU affinity of pid {pid}: {exc}"
            raise FaultError(msg) from exc
        argv = self._argv(check_params(spec, self.describe()), cpus, spec.duration_s)
        try:
            child = subprocess.Popen(argv, env={**os.environ, TAG_ENV: tag}, start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        except OSError as exc:
            raise FaultError(f"{target.replica_id}: cannot start {argv[0]}: {exc}") from exc
        started = process_start_time(child.pid, self._proc)
        self._children[child.pid] = child
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
            and process_start_time(pid, self._proc) == started
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
        while left := [p for p in self._strays(token) if _state(p, self._proc) not in (None, "Z")]:
            if time.monotonic() > deadline:
                raise RevertFailed(f"{token.target}: stressor processes {left} still running", retryable=True)
            time.sleep(0.05)
        logger.info("%s: stressor (tag %s) killed", token.target, tag[:8])

    def _strays(self, token: RevertToken) -> list[int]:
        """What is left of the stressor: processes with its tag, and (stress-ng workers overwrite their
        environment with their title) members of its process group started no earlier than its leader."""
        found = set(tagged_pids(str(token.data["tag"]), self._proc))
        pgid, started = token.data.get("pid"), token.data.get("start_time")
        if isinstance(pgid, int) and isinstance(started, int):
            prefix = "stress-ng" if token.data.get("backend") == "stress-ng" else "python"
            found |= set(group_pids(pgid, since=started, comm_prefix=prefix, proc=self._proc))
        return sorted(found)

    def _argv(self, params: dict[str, Scalar], cpus: Sequence[int], duration_s: float) -> list[str]:
        workers, load, vm_bytes = int(_num(params["cpu_workers"])), _num(params["cpu_load"]), \
            int(_num(params["vm_bytes"]))
        seconds = math.ceil(duration_s) + TIMEOUT_GRACE_S
        if self._backend == "python":
            return [sys.executable, "-c", BURNER, str(workers), f"{load:g}", str(vm_bytes), str(seconds),
                    ",".join(map(str, cpus))]
        argv = [str(self._stress_ng), "--taskset", ",".join(map(str, cpus)), "--timeout", f"{seconds}s",
                "--quiet"]
        if workers:
            argv += ["--cpu", str(workers), "--cpu-load", f"{load:g}"]
        if vm_bytes:
            argv += ["--vm", "1", "--vm-bytes", str(vm_bytes), "--vm-keep"]
        return argv

    def _checked_pid(self, target: Target) -> int:
        pid = target.pid
        if pid is None or pid <= 1 or process_start_time(pid, self._proc) is None:
            raise FaultError(f"{target.replica_id}: no local process to stress next to (pid {pid!r})")
        return pid


def tagged_pids(tag: str, proc: Path = PROC) -> list[int]:
    """Processes whose environment carries ``CHAOS_STRESS_TAG=<tag>`` (a pid reused by others never does)."""
    needle = f"{TAG_ENV}={tag}".encode()
    return sorted(pid for pid, environ in _environs(proc) if needle in environ.split(b"\0"))


def group_pids(pgid: int, *, since: int, comm_prefix: str, proc: Path = PROC) -> list[int]:
    """Members of process group ``pgid`` started at or after ``since`` whose name starts with the prefix."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and int(fields[19]) >= since and comm.startswith(comm_prefix):
            found.append(int(entry.name))
    return sorted(found)


def _environs(proc: Path) -> Iterator[tuple[int, bytes]]:
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            yield int(entry.name), (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue


def _state(pid: int, proc: Path) -> str | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def _num(value: Scalar) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def faults() -> list[Fault]:
    """The catalogue's hook for optional fault modules."""
    return [StressFault()]
