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
``SCHED_IDLE`` needs no privilege; leaving them would, so a worker only ever serves work of its own
priority.

A worker serves one request after another and stays, idle and blocked on its stdin, for the next
(:class:`_Pool`: one per module and priority, closed after ``WORKER_IDLE_S`` without work). Each start
costs an interpreter and the simulator's imports, 0.34 s of CPU: the API's fuzz test sends 182 what-if
runs, most of them small or refused, which spent 62.6 of its 71.8 s of server time starting workers.

A worker lowers itself after its interpreter has started and its module is imported (about 0.25 s of
normal priority), not from its first instruction. Lowered by its caller as soon as it existed, the gateway
fared worse beside it: ``python -m controlplane.bench gateway --control-plane busy --levels 1 --requests
1600``, alternating (2026-12-05), added P50 TTFT 1.51 and 1.46 ms against 0.48 and 0.64 ms, and 1.47 ms in
a full run against 0.68-0.70 in three. The cause was not found; the measured order is kept.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from inference.environment import child_environment

logger = logging.getLogger(__name__)

BATCH_NICE = 10  # as `nice` does by default; also where SCHED_IDLE is not available
WORKER_EXIT_TIMEOUT_S = 5.0  # for a worker to exit once its stdin is closed
WORKER_IDLE_S = 120.0  # an idle worker kept this long for the next request, then closed


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


class _Pool:
    """Idle workers kept for the next request of the same module and priority: one each (the API runs one
    what-if at a time), closed by a timer after ``WORKER_IDLE_S`` without work, or at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str], tuple[subprocess.Popen[str], threading.Timer]] = {}

    def take(self, key: tuple[str, str]) -> subprocess.Popen[str] | None:
        with self._lock:
            kept = self._idle.pop(key, None)
        if kept is None:
            return None
        worker, timer = kept
        timer.cancel()
        if worker.poll() is None:
            return worker
        _close(worker)
        return None

    def give_back(self, key: tuple[str, str], worker: subprocess.Popen[str]) -> None:
        timer = threading.Timer(WORKER_IDLE_S, self._expire, args=(key, worker))
        timer.daemon = True
        with self._lock:
            previous = self._idle.pop(key, None)
            self._idle[key] = (worker, timer)
        timer.start()
        if previous is not None:  # two runs at once (not through the API): keep the newer one
            previous[1].cancel()
            _close(previous[0])

    def _expire(self, key: tuple[str, str], worker: subprocess.Popen[str]) -> None:
        with self._lock:
            kept = self._idle.get(key)
            if kept is None or kept[0] is not worker:
                return  # taken meanwhile
            del self._idle[key]
        _close(worker)

    def close(self) -> None:
        with self._lock:
            kept, self._idle = list(self._idle.values()), {}
        for worker, timer in kept:
            timer.cancel()
            _close(worker)


WORKERS = _Pool()
atexit.register(WORKERS.close)


def close_idle_workers() -> None:
    """Close every idle worker now (the control plane's exit does it too)."""
    WORKERS.close()


def _close(worker: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError):
        if worker.stdin is not None:
            worker.stdin.close()  # the worker's cue to exit, at once, whatever it was doing
    try:
        worker.wait(timeout=WORKER_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()
    with contextlib.suppress(OSError):
        if worker.stdout is not None:
            worker.stdout.close()


def _start(module: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=child_environment())


class _NoAnswer(RuntimeError):
    """The worker's stdout ended before it wrote a line of the protocol."""


def run_batch_process(module: str, request: dict[str, Any],
                      progress: Callable[[dict[str, Any]], None] | None = None, *,
                      priority: str = "idle") -> dict[str, Any]:
    """Run ``request`` in a worker ``python -m module`` (:func:`serve_batch_work`), started now or kept
    from an earlier request of the same ``priority`` (the one the worker lowered itself to at its first;
    the caller names it): it gets ``request`` as one JSON line on stdin and answers with JSON lines on
    stdout, ``{"progress": ...}`` any number of times (each handed to ``progress``), then ``{"result":
    ...}`` or ``{"error": message, "bad_input": bool}``. ValueError: the worker refused its input;
    RuntimeError: it failed or died without an answer. A worker that answered (or refused) is kept for the
    next request; one that failed, or whose caller raised (``progress`` did, or the thread was
    interrupted), has its stdin closed, which stops it at once, so no run outlives its caller. Secrets stay
    out of its environment."""
    key = (module, priority)
    kept = WORKERS.take(key)
    if kept is not None:
        try:
            return _run_on(kept, key, request, progress)
        except _NoAnswer:
            pass  # it had gone (exited, or killed) while idle: a fresh one runs the request
    try:
        return _run_on(_start(module), key, request, progress)
    except _NoAnswer as exc:
        raise RuntimeError(str(exc)) from None


def _run_on(worker: subprocess.Popen[str], key: tuple[str, str], request: dict[str, Any],
            progress: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    module = key[0]
    assert worker.stdin is not None and worker.stdout is not None
    keep = False
    said = False
    try:
        try:
            worker.stdin.write(json.dumps(request) + "\n")
            worker.stdin.flush()
        except (BrokenPipeError, ValueError):  # ValueError: its pipe was closed already
            pass  # read to its end below: it says why, or _NoAnswer
        for line in worker.stdout:
            said = True
            try:
                message = json.loads(line)
            except json.JSONDecodeError:  # not the protocol's: never taken for the worker's answer
                logger.warning("%s wrote a line that is not JSON: %.200s", module, line.rstrip())
                continue
            if "progress" in message:
                if progress is not None:
                    progress(message["progress"])
            elif "result" in message:
                keep = True
                return dict(message["result"])
            elif "error" in message:
                if message.get("bad_input"):
                    keep = True
                    raise ValueError(str(message["error"]))
                raise RuntimeError(f"{module}: {message['error']}")
    finally:
        if keep:
            WORKERS.give_back(key, worker)
        else:
            _close(worker)
    gone = f"{module} exited with status {worker.returncode} and no answer (see the log)"
    raise RuntimeError(gone) if said else _NoAnswer(gone)


def serve_batch_work(handle: Callable[[dict[str, Any], Callable[[dict[str, Any]], None]], dict[str, Any]],
                     idle: Callable[[dict[str, Any] | None], bool] = lambda request: True) -> int:
    """A worker's main loop for :func:`run_batch_process`: lowers the process's priority before any work
    (``SCHED_IDLE`` unless ``idle(first request)`` says no: nice alone), then answers each request line on
    stdin with ``handle(request, progress)``, where ``progress(message)`` reports and the return value is
    the result; a ValueError it raises is a refusal (``bad_input``). Any other exception is written as an
    error and ends the worker (status 1). It exits as soon as its stdin closes, mid-run too (status 1
    then, else 0): the caller gave up on the run, or stopped, even by ``kill -9``."""
    line = sys.stdin.readline()
    if not line:
        return 0  # closed before it asked anything
    first = _read_request(line)  # None: refused below, at the lowest priority still
    as_batch_work(idle=idle(first))  # before any work: every thread the process starts inherits it
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # the protocol's own channel ...
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # ... and whatever else prints goes to the log
    out_lock = threading.Lock()
    busy = threading.Event()
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line)
        os._exit(1 if busy.is_set() or not lines.empty() else 0)

    def emit(message: dict[str, Any]) -> None:
        with out_lock:
            answers.write(json.dumps(message) + "\n")
            answers.flush()

    threading.Thread(target=read, name="stdin", daemon=True).start()
    request = first
    while True:
        busy.set()
        try:
            if request is None:
                raise ValueError("the request is not a JSON object")
            result = handle(request, lambda message: emit({"progress": message}))
        except ValueError as exc:  # pydantic's ValidationError is one too
            emit({"error": str(exc), "bad_input": True})
        except Exception as exc:
            emit({"error": f"{type(exc).__name__}: {exc}", "bad_input": False})
            return 1
        else:
            emit({"result": result})
        busy.clear()
        request = _read_request(lines.get())


def _read_request(line: str) -> dict[str, Any] | None:
    try:
        request = json.loads(line)
    except ValueError:
        return None
    return request if isinstance(request, dict) else None
