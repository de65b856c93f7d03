"""Process faults: kill (SIGKILL), terminate (SIGTERM) and pause (SIGSTOP, reverted with SIGCONT).

Kill and terminate revert to nothing: the fleet restarts the replica. A pause token records the pid and
the process's start time (psutil), so revert never signals a recycled pid: a process that is gone, or a
pid that now belongs to someone else, counts as already reverted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass

import psutil

from chaos.faults.base import (
    Fault,
    FaultError,
    FaultKindInfo,
    FaultSpec,
    RevertFailed,
    RevertToken,
    check_params,
)
from chaos.targets import Target

logger = logging.getLogger(__name__)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)  # what SIGSTOP leaves a process in


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot; None when it is gone. Ticks, as the kernel counts
    them, are what revert tokens in the ledger have always held: a token written before an upgrade still
    matches its process."""
    try:
        created = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return start_ticks(created)


def start_ticks(created: float) -> int:
    """psutil's creation time (POSIX seconds) back in clock ticks since boot, exactly: psutil adds the
    same boot time to the kernel's ticks."""
    return round((created - psutil.boot_time()) * CLOCK_TICKS)


STOP_SETTLE_S = 5.0  # how long a SIGSTOP may take to stop a process on a busy machine


def process_state(pid: int) -> str | None:
    """psutil's status of ``pid`` (``psutil.STATUS_*``: running, sleeping, stopped, zombie...); None when
    the process is gone."""
    try:
        return str(psutil.Process(pid).status())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


@dataclass(slots=True, frozen=True)
class _Kind:
    kind: str
    sig: signal.Signals
    revert_signal: signal.Signals | None
    description: str


_KINDS = {
    "kill": _Kind("kill", signal.SIGKILL, None, "SIGKILL the replica process; the fleet restarts it"),
    "terminate": _Kind("terminate", signal.SIGTERM, None,
                       "SIGTERM the replica process (graceful drain); the fleet restarts it"),
    "pause": _Kind("pause", signal.SIGSTOP, signal.SIGCONT,
                   "SIGSTOP the replica process (it stops answering); revert sends SIGCONT"),
}


class ProcessFault(Fault):
    def __init__(self, kind: str) -> None:
        if kind not in _KINDS:
            raise ValueError(f"kind: must be one of {', '.join(_KINDS)}, got {kind!r}")
        self._kind = _KINDS[kind]

    def describe(self) -> FaultKindInfo:
        return FaultKindInfo(kind=self._kind.kind, family="process", description=self._kind.description,
                             takes_down=True)

    def validate(self, spec: FaultSpec) -> None:
        if spec.kind != self._kind.kind:
            raise ValueError(f"kind: expected {self._kind.kind!r}, got {spec.kind!r}")
        check_params(spec, self.describe())

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        pid = self._checked_pid(target)
        started = process_start_time(pid)
        if started is None:
            raise FaultError(f"{target.replica_id}: process {pid} is not running")
        action = "signal" if self._kind.revert_signal is not None else "none"
        data: dict[str, str | int | float | bool | None] = {"pid": pid, "start_time": started}
        if self._kind.revert_signal is not None:
            data["signal"] = self._kind.revert_signal.name
        return RevertToken(kind=self._kind.kind, target=target.replica_id, action=action, data=data)

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        self.validate(spec)
        token = self.prepare(spec, target)
        pid = int(token.data["pid"] or 0)
        # prepare() just read the start time; read it again so a pid recycled in between is left alone.
        if process_start_time(pid) != token.data["start_time"]:
            raise FaultError(f"{target.replica_id}: process {pid} went away before {self._kind.kind}")
        try:
            os.kill(pid, self._kind.sig)
        except ProcessLookupError as exc:
            msg = f"{target.replica_id}: process {pid} went away before {self._kind.kind}"
            raise FaultError(msg) from exc
        except PermissionError as exc:
            raise FaultError(f"{target.replica_id}: not allowed to signal process {pid}") from exc
        logger.warning("%s: sent %s to pid %d", target.replica_id, self._kind.sig.name, pid)
        if self._kind.sig == signal.SIGSTOP:
            await self._stopped(pid, target.replica_id)
        return token

    async def _stopped(self, pid: int, replica_id: str) -> None:
        """Return once the process is stopped: a signal takes effect when the process next runs, which on
        a busy machine can be a while after kill() returned, and the fault is in place only then."""
        deadline = time.monotonic() + STOP_SETTLE_S
        while process_state(pid) not in (*STOPPED, None):
            if time.monotonic() > deadline:
                raise FaultError(f"{replica_id}: pid {pid} still running {STOP_SETTLE_S:g}s after SIGSTOP")
            await asyncio.sleep(0.01)

    async def revert(self, token: RevertToken) -> None:
        if token.action == "none":
            return
        if token.action != "signal":
            raise RevertFailed(f"{token.target}: unknown revert action {token.action!r}", retryable=False)
        pid, started = token.data.get("pid"), token.data.get("start_time")
        name = str(token.data.get("signal", "SIGCONT"))
        if not isinstance(pid, int) or not isinstance(started, int) or name not in signal.Signals.__members__:
            raise RevertFailed(f"{token.target}: malformed revert token {token.to_json()!r}", retryable=False)
        if process_start_time(pid) != started:
            logger.info("%s: pid %d is gone or recycled; nothing to revert", token.target, pid)
            return
        try:
            os.kill(pid, signal.Signals[name])
        except ProcessLookupError:
            return
        except PermissionError as exc:
            msg = f"{token.target}: not allowed to signal process {pid}"
            raise RevertFailed(msg, retryable=False) from exc
        logger.warning("%s: sent %s to pid %d", token.target, name, pid)

    def _checked_pid(self, target: Target) -> int:
        pid = target.pid
        if pid is None or pid <= 1:
            raise FaultError(f"{target.replica_id}: no local process to signal (pid {pid!r})")
        if pid == os.getpid():
            raise FaultError(f"{target.replica_id}: refusing to signal this process (pid {pid})")
        return pid


def process_faults() -> list[Fault]:
    return [ProcessFault(kind) for kind in _KINDS]
