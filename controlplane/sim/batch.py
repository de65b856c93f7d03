"""The control plane's batch work yields the CPU: what-if simulations run in processes of idle priority.

Where it sits: the gateways and the replicas are processes of their own, so nothing the control plane does
blocks their event loops; but on a shared host they still compete with it for CPU time. A what-if
simulation can keep a core busy for seconds to minutes, so it runs in a worker process
(:func:`run_batch_process`) under Linux's ``SCHED_IDLE`` policy, with its nice value raised as well: the
data plane, and the control plane's own loops and API, come first, and a gateway or replica that wakes up
preempts the simulation at once. Under nice 10 alone the kernel let the simulation finish its slice
first: the gateway benchmark with a busy control plane (``python -m controlplane.bench gateway
--control-plane busy --levels 16,64``, alternating runs on 2026-12-05) measured the gateway's added P50
TTFT at 0.11-1.78 ms at 16 streams and -3.80 to -0.82 ms at 64 under ``SCHED_IDLE`` (six runs), against
1.65-3.37 and 2.25-6.00 ms under nice 10 alone (four), for about 6% fewer what-if runs in the same time.
The price: on a host whose cores stay busy (replicas serving flat out), a what-if runs only in the gaps
and can take much longer.

A process, not a thread of the control plane: a Python thread under ``SCHED_IDLE`` holds the interpreter
lock while it computes and, on a host kept busy by normal work, waits long for a gap in which to run and
hand the lock back; every other thread of its process waits with it. With two CPU hogs on this 2-core
machine, a normal thread woke 1.35 s late (p50, a 10 ms sleep and a little Python work, repeated) beside
an idle-priority thread computing in the same process, against 0.10 ms without it: the control plane's
loops and API would have stalled exactly when its host was saturated. Raising a nice value or entering
``SCHED_IDLE`` needs no privilege; leaving them would, so a worker is never reused.

A worker lowers itself after its interpreter has started and its module is imported (about 0.25 s of
normal priority), not from its first instruction. Lowered by its caller as soon as it existed, the gateway
fared worse beside it: ``python -m controlplane.bench gateway --control-plane busy --levels 1 --requests
1600``, alternating (2026-12-05), added P50 TTFT 1.51 and 1.46 ms against 0.48 and 0.64 ms, and 1.47 ms in
a full run against 0.68-0.70 in three. The cause was not found; the measured order is kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from inference.environment import child_environment

logger = logging.getLogger(__name__)

BATCH_NICE = 10  # as `nice` does by default; also where SCHED_IDLE is not available
WORKER_EXIT_TIMEOUT_S = 5.0  # for a worker to exit once its stdin is closed


def as_batch_work(nice: int = BATCH_NICE, *, idle: bool = True) -> None:
    """Lower the calling thread's CPU priority: ``SCHED_IDLE`` and ``nice`` (each a no-op where the platform
    has no such per-thread setting). Threads it starts afterwards inherit both; call it first thing in a
    worker process, never on a thread of a process that also serves. ``idle=False``: the nice value
    alone."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):  # never raised: a process started nicer stays so
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    if idle:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def run_batch_process(module: str, request: dict[str, Any],
                      progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``python -m module`` as batch work: it gets ``request`` as one JSON line on stdin and answers
    with JSON lines on stdout, ``{"progress": ...}`` any number of times (each handed to ``progress``), then
    ``{"result": ...}`` or ``{"error": message, "bad_input": bool}``. The module lowers its own priority
    (:func:`as_batch_work`) and exits when its stdin closes, which this function does when it returns or
    raises, so no worker outlives its caller. ValueError: the worker refused its input; RuntimeError: it
    failed or died without an answer. Secrets stay out of its environment."""
    command = [sys.executable, "-m", module]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env=child_environment()) as worker:
        assert worker.stdin is not None and worker.stdout is not None
        try:
            worker.stdin.write(json.dumps(request) + "\n")
            worker.stdin.flush()
            for line in worker.stdout:
                try:
                    message = json.loads(line)
                except json.JSONDecodeError:  # not the protocol's: never taken for the worker's answer
                    logger.warning("%s wrote a line that is not JSON: %.200s", module, line.rstrip())
                    continue
                if "progress" in message:
                    if progress is not None:
                        progress(message["progress"])
                elif "result" in message:
                    return dict(message["result"])
                elif "error" in message:
                    if message.get("bad_input"):
                        raise ValueError(str(message["error"]))
                    raise RuntimeError(f"{module}: {message['error']}")
        finally:
            with contextlib.suppress(OSError):
                worker.stdin.close()  # the worker's cue to exit, if it has not
            try:
                worker.wait(timeout=WORKER_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                worker.kill()
        raise RuntimeError(f"{module} exited with status {worker.returncode} and no answer (see the log)")
