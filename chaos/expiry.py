"""Expiry guards: a fault's duration holds even when the process that injected it dies.

Where it sits: beside :class:`chaos.safety.FaultManager`. Some faults end by themselves where they live (a
replica's fault hook, a gateway's toxic, stress-ng's ``--timeout``); others stay until someone reverts
them (a paused process stays stopped, a partition stays attached). For those the manager starts a guard
when it injects: ``python -m chaos.expiry``, a small process in its own session that sleeps until the
fault's expiry and then reverts it with the same revert token and the same kind's ``revert``
(idempotent), then exits. When the manager reverts first, it stops the guard. A control plane killed with
``kill -9`` mid-fault thus leaves no fault active past its expiry; the next control plane still reverts
what the ledger says is active (a no-op by then) and records it.

The guard reads its order on stdin (JSON: fault id, the revert token, the wall-clock expiry), so nothing
about the fault shows in ``ps``; it never holds a secret (revert tokens carry none).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from chaos.catalogue import default_catalogue
from chaos.faults.base import Fault, RevertToken
from inference.environment import child_environment
from inference.models.bundled import STATE_DIR_ENV

logger = logging.getLogger(__name__)

GRACE_S = 0.0  # the guard reverts at expiry; the manager's own timer normally gets there first
START_TIMEOUT_S = 5.0
FAULT_ENV = "LLMSRE_EXPIRY_FAULT"  # in a guard's environment: the ledger id of the fault it guards


def needs_guard(fault: Fault, token: RevertToken) -> bool:
    """Whether ``fault`` stays in place until reverted (and there is something to revert)."""
    return not fault.expires_by_itself and token.action != "none"


class ExpiryGuards:
    """Starts and stops guard processes; ``environment`` builds a guard's environment (no secrets)."""

    def __init__(self, *, environment: Callable[[], Mapping[str, str]] = child_environment,
                 python: str = sys.executable, wall: Callable[[], float] = time.time) -> None:
        self.environment, self.python, self.wall = environment, python, wall
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, fault_id: int, token: RevertToken, expires_in_s: float) -> int | None:
        """A guard for one fault; its pid, or None when it could not start (logged: the manager's own
        timer still reverts the fault while the manager lives)."""
        order = {"fault_id": fault_id, "token": token.to_json(), "expires_at": self.wall() + expires_in_s}
        try:
            child = subprocess.Popen([self.python, "-m", "chaos.expiry"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**self.environment(), FAULT_ENV: str(fault_id)},
                                     start_new_session=True)
            assert child.stdin is not None
            child.stdin.write(json.dumps(order).encode())
            child.stdin.close()
        except OSError as exc:
            logger.error("fault %d: no expiry guard (%s); only this process will revert it", fault_id, exc)
            return None
        self._children[child.pid] = child
        return child.pid

    def stop(self, pid: int | None, fault_id: int | None = None) -> None:
        """Stop the guard of fault ``fault_id``, reverted already (idempotent; a guard of an earlier run
        too: signalled only while ``pid`` still runs a guard of that fault for this environment's state
        folder, since a pid from the ledger may have been reused by anything since, another control
        plane's guard included)."""
        if pid is None:
            return
        child = self._children.pop(pid, None)
        if child is not None:  # ours: signalled only while unreaped (a reaped guard's pid may run anything)
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(START_TIMEOUT_S)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if fault_id is not None and _is_guard(pid, fault_id, self.environment().get(STATE_DIR_ENV)):
                os.kill(pid, signal.SIGTERM)

    def reap(self) -> None:
        """Forget guards that exited on their own (after reverting at expiry)."""
        for pid, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[pid]


def _is_guard(pid: int, fault_id: int, state_dir: str | None) -> bool:
    """``pid`` runs the guard of ``fault_id`` started with ``state_dir`` in its environment (or none)."""
    try:
        process = psutil.Process(pid)
        args, env = process.cmdline(), process.environ()
    except psutil.Error:  # gone, or another user's: not ours to signal
        return False
    return "chaos.expiry" in args and env.get(FAULT_ENV) == str(fault_id) and \
        env.get(STATE_DIR_ENV) == state_dir


# ---- the guard process ----------------------------------------------------------------------------------
async def guard(order: Mapping[str, Any], catalogue_kind: Callable[[str], Fault]) -> int:
    """Sleep until expiry, then revert; the exit status says how it went (0 reverted, 1 failed)."""
    token = RevertToken.from_json(order["token"])
    delay = float(order["expires_at"]) + GRACE_S - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    fault = catalogue_kind(token.kind)
    try:
        await fault.revert(token)
    except Exception as exc:
        print(f"chaos.expiry: fault {order.get('fault_id')} ({token.kind} on {token.target}): revert failed: "
              f"{exc}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # reverted by the manager already: nothing to do
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the control plane
    order = json.loads(sys.stdin.read())
    catalogue = default_catalogue()  # the kinds' revert needs no token: pids, filters
    return asyncio.run(guard(order, catalogue.get))


if __name__ == "__main__":
    sys.exit(main())
