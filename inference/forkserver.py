"""Replicas forked from a process that has already imported them: a replica's start without its imports,
as Python's ``multiprocessing`` forkserver with a preload, or a preforking web server, does it.

``python -m inference serve`` spends most of its start importing: torch alone takes about 1.2 s of CPU,
and the replica is ready 2.4-3.7 s after its exec on this project's 2-core test host (2.4-3.2 s of CPU).
The fork server (``python -m inference.forkserver``) imports the replica's code once (:data:`PRELOAD`:
torch, the engine, the HTTP server; nothing that opens a device, so a CUDA or NPU replica initialises its
device after the fork, as it must), then forks one child per request, and the child runs ``python -m
inference`` with the request's arguments: ready 0.5-0.6 s after the fork, for about 0.45 s of CPU.

From outside, a forked replica looks like an exec'd one: its own session, its log file on stdout and
stderr, its own command line (written over the fork server's, which is exec'd with :data:`ROOM` bytes of
blank argument to make room for it: what ``ps``, psutil and the control plane's adoption read), and the
fork server's environment in ``/proc/<pid>/environ``, updated in the process (``os.environ``) with the
request's: a secret such as the admin token comes over the pipe, never on a command line. Variables that
libraries read as they load (``OMP_WAIT_POLICY``) are the fork server's own, so its client starts it with
the replicas' environment (:func:`inference.launcher.replica_environment`).

The protocol is JSON lines. The client writes ``{"id", "argv", "env", "log"}`` to the server's stdin; the
server answers ``{"id", "pid"}`` or ``{"id", "error"}`` on its stdout, ``{"ready": true}`` once it has
imported everything (``{"failed": reason}`` if it could not), and ``{"exited": pid, "status": code}`` when
it reaps a child (``code`` as ``Popen.returncode``: negative for a signal). It exits at the end of its
input: when its client (the control plane) is gone, its replicas go on serving, each in its own session,
and init reaps them.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import selectors
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from inference.environment import child_environment

PRELOAD = ("inference.__main__", "inference.replica")
ROOM = 4096  # bytes of command line a forked replica may show (a fleet's replica takes 300-600)
READY_TIMEOUT_S = 60.0  # the imports take 1.5-3 s on a quiet host; a busy one may take several times that
ANSWER_TIMEOUT_S = 10.0  # a fork takes milliseconds


class ForkServerError(RuntimeError):
    """The fork server cannot fork this replica; the message says why."""


# ---- the server ----------------------------------------------------------------------------------------

def main() -> int:
    set_command_line([sys.executable, "-m", "inference.forkserver"])
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except Exception as exc:  # the client falls back on exec'd replicas and logs this
        _send({"failed": f"{type(exc).__name__}: {exc}"})
        return 1
    gc.freeze()  # what the imports made stays in pages the children share, not copied by their collector
    _send({"ready": True})
    buffer = b""
    with selectors.EpollSelector() as selector:
        selector.register(0, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fd != 0:  # a child's pidfd: it exited
                    selector.unregister(key.fd)
                    os.close(key.fd)
                    _reap()
                    continue
                chunk = os.read(0, 1 << 16)
                if not chunk:  # the client is gone
                    return 0
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    _fork(json.loads(line), selector)


def _fork(request: dict[str, Any], selector: selectors.EpollSelector) -> None:
    """Fork the replica; its pidfd in ``selector`` wakes the loop when it exits, to reap it at once."""
    title = [sys.executable, "-m", "inference", *request["argv"]]
    try:
        _fits(title)
        pid = os.fork()
    except (OSError, ValueError) as exc:
        _send({"id": request["id"], "error": str(exc)})
        return
    if pid == 0:
        _become(request, title, [selector.fileno(), *(k.fd for k in selector.get_map().values() if k.fd)])
    _send({"id": request["id"], "pid": pid})
    try:
        selector.register(os.pidfd_open(pid), selectors.EVENT_READ)
    except OSError:  # gone and reaped already, or no pidfd: the next wake-up reaps it
        _reap()


def _become(request: dict[str, Any], title: list[str], inherited: list[int]) -> NoReturn:
    """In the child: what an exec would have given it, then ``python -m inference`` itself; never returns
    into the fork server's loop."""
    code = 1
    try:
        set_command_line(title)  # first: a moment after the fork it already reads as the replica
        for fd in inherited:  # the fork server's selector and its other children's pidfds
            os.close(fd)
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        log = null if request["log"] is None else \
            os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for fd, source in ((0, null), (1, log), (2, log)):
            os.dup2(source, fd)
        for fd in {null, log}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        replica = sys.modules["inference.__main__"]
        sys.argv = [str(replica.__file__), *request["argv"]]
        code = replica.main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exited": pid, "status": os.waitstatus_to_exitcode(status)})


def _send(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


# ---- the command line ----------------------------------------------------------------------------------

def _argument_area() -> tuple[int, int]:
    """Where this process's arguments lie in its memory (``arg_start`` and ``arg_end``, fields 48 and 49 of
    ``/proc/self/stat``; the kernel reads ``/proc/<pid>/cmdline`` from there)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[48 - 3]), int(fields[49 - 3])  # the fields after the name start at field 3


def _encoded(args: Sequence[str]) -> bytes:
    return b"".join(os.fsencode(a) + b"\0" for a in args)


def _fits(args: Sequence[str]) -> None:
    start, end = _argument_area()
    if len(_encoded(args)) + 2 > end - start:
        raise ValueError(f"a command line of {len(_encoded(args))} bytes does not fit the fork server's "
                         f"{end - start}")


def set_command_line(args: Sequence[str]) -> None:
    """Show ``args`` as this process's command line (``/proc/<pid>/cmdline``: what ``ps``, psutil and
    readers of the raw file see), NUL-separated as exec writes them, within the room its own took; the
    rest reads as one more argument of blanks (the area must end in a NUL for the kernel to read it as
    arguments, and only privileged processes may move its end)."""
    _fits(args)
    start, end = _argument_area()
    data = _encoded(args)
    data += b" " * (end - start - len(data) - 1) + b"\0"
    ctypes.memmove(start, data, len(data))


# ---- the client ----------------------------------------------------------------------------------------

def unavailable() -> str | None:
    """Why replicas cannot be forked here, or None: each forked replica is held by a pidfd (Linux 5.3)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as exc:
        return f"no pidfd on this system ({type(exc).__name__}: {exc})"
    return None


class ForkServer:
    """A fork server of our own: started at once (it imports in the background), asked for replicas by
    :meth:`spawn` once :meth:`wait_ready`; :meth:`close` stops it (its replicas go on)."""

    def __init__(self, env: Mapping[str, str], log_path: Path | None = None) -> None:
        """``env`` less any secret (:func:`~inference.environment.child_environment`): every replica it
        forks shows it in ``/proc/<pid>/environ``; a replica's secret comes with its request.
        ``ForkServerError`` where this system cannot hold forked replicas (:func:`unavailable`)."""
        if (why := unavailable()) is not None:
            raise ForkServerError(why)
        with open(log_path, "ab") if log_path is not None else open(os.devnull, "wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "inference.forkserver", " " * ROOM],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            env=child_environment(base=env), start_new_session=True)
        self._cond = threading.Condition()
        self._answers: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._ready = False
        self.failure: str | None = None  # why it cannot fork, once it cannot
        self.died = False  # it was ready, then exited (killed, or its input closed)
        self._next_id = 0
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with contextlib.suppress(ValueError), self._cond:
                message = json.loads(line)
                if "exited" in message:
                    self._exits[int(message["exited"])] = int(message["status"])
                elif "id" in message:
                    self._answers[int(message["id"])] = message
                elif message.get("ready"):
                    self._ready = True
                elif "failed" in message:
                    self.failure = f"its imports failed: {message['failed']}"
                self._cond.notify_all()
        status = self.process.wait()
        with self._cond:
            self.died = self._ready  # it had forked, or could have: another one may be started
            self.failure = self.failure or f"the fork server exited with {status}"
            self._cond.notify_all()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self.failure is not None, timeout):
                raise ForkServerError(f"the fork server had not imported the replica after {timeout:g}s")
            if self.failure is not None:
                raise ForkServerError(self.failure)

    @property
    def ready(self) -> bool:
        with self._cond:
            return self._ready and self.failure is None

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path | None) -> ForkedProcess:
        """Fork ``python -m inference ARGV`` with ``env``, its output appended to ``log_path``."""
        assert self.process.stdin is not None
        with self._cond:
            if self.failure is not None or not self._ready:
                raise ForkServerError(self.failure or "the fork server is still importing the replica")
            self._next_id += 1
            request_id = self._next_id
            line = json.dumps({"id": request_id, "argv": list(argv), "env": dict(env),
                               "log": None if log_path is None else str(log_path)}) + "\n"
            try:
                self.process.stdin.write(line.encode())
                self.process.stdin.flush()
            except OSError as exc:
                raise ForkServerError(f"the fork server does not read: {exc}") from None
            if not self._cond.wait_for(lambda: request_id in self._answers or self.failure is not None,
                                       ANSWER_TIMEOUT_S):
                raise ForkServerError(f"the fork server did not answer in {ANSWER_TIMEOUT_S:g}s")
            answer = self._answers.pop(request_id, None)
        if answer is None:
            raise ForkServerError(self.failure or "the fork server is gone")
        if "error" in answer:
            raise ForkServerError(answer["error"])
        return ForkedProcess(int(answer["pid"]), self)

    def exit_status(self, pid: int, timeout: float) -> int | None:
        """The status of ``pid`` once the fork server reaped it, handed out once (its
        :class:`ForkedProcess` keeps it); None when it cannot say within ``timeout`` (it is gone: init
        reaped the child instead)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self.failure is not None, timeout)
            return self._exits.pop(pid, None)

    def close(self, timeout: float = 5.0) -> None:
        """End its input: it exits, and the replicas it forked go on."""
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ForkedProcess:
    """A replica the fork server forked, held by a pidfd: a signal reaches this process or none, never a
    later one under its pid, and its exit shows at once; its status comes from the fork server, which
    reaps it (None where the fork server is gone and could not say)."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self._server = server
        self.returncode: int | None = None  # once it exited and the fork server said how
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # it exited already, and the fork server reaped it
            self._pidfd = -1
            self.returncode = server.exit_status(pid, timeout=2.0)

    def running(self) -> bool:
        if self._pidfd < 0:
            return False
        if not select.select([self._pidfd], [], [], 0)[0]:
            return True
        self._exited()
        return False

    def wait(self, timeout: float | None = None) -> int | None:
        """Its status once it exits (as ``Popen.wait``: ``TimeoutExpired`` after ``timeout``)."""
        if self._pidfd >= 0 and not select.select([self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        self._exited()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def _exited(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
            self.returncode = self._server.exit_status(self.pid, timeout=2.0)


def still_running(process: subprocess.Popen[bytes] | ForkedProcess) -> bool:
    """An exec'd child (reaped here once it exited) or a forked one (its pidfd tells) still runs."""
    return process.running() if isinstance(process, ForkedProcess) else process.poll() is None


if __name__ == "__main__":
    sys.exit(main())
