"""The console as a process beside the control plane: started by ``controlplane up``, adopted after a crash.

The console (``python -m dashboards``) talks to the REST API like any client, and the layers forbid the
control plane to import it, so it runs as a process of its own, in its own session. Its pid is kept in
the store: when a control plane killed with ``kill -9`` is started again, the console it left (which went
on serving its users, and says in its banner that the control plane is gone) is adopted, not orphaned,
and is stopped with the rest at Ctrl-C. Its session secret is fresh for every console started here, and
goes in its environment (``ps`` shows argv); the operators' own tokens and passwords do not: the console
acts only with each logged-in user's token.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import subprocess
import sys
from typing import Any, Protocol

import psutil

from controlplane.config import Config
from inference.environment import child_environment

logger = logging.getLogger(__name__)

CONSOLE_SECRET_ENV = "CONTROLPLANE_CONSOLE_SECRET"  # read by ``python -m dashboards``
PID_KEY = "console.pid"
STOP_TIMEOUT_S = 5.0


class ConsoleStore(Protocol):
    def kv_put(self, key: str, value: Any) -> None: ...

    def kv_get(self, key: str, default: Any = None) -> Any: ...


class ConsoleProcess:
    """The console this control plane started or adopted (``pid``), stopped by :meth:`stop`."""

    def __init__(self, process: psutil.Process, child: subprocess.Popen[bytes] | None) -> None:
        self.process, self._child = process, child

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except psutil.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        if self._child is not None:
            self._child.poll()  # reaped: no zombie


def command(cfg: Config, api_url: str) -> list[str]:
    con = cfg.console
    return [sys.executable, "-m", "dashboards", "--api", api_url, "--host", con.host, "--port", str(con.port),
            "--refresh-s", str(con.refresh_s), "--session-ttl-s", str(con.session_ttl_s)]


def start_console(cfg: Config, store: ConsoleStore, api_url: str) -> ConsoleProcess | None:
    """Adopt the console an earlier control plane left on this port, else start one; None when it is off
    or its port is taken by something else (logged)."""
    if not cfg.console.enabled:
        return None
    adopted = _adopt(cfg, store)
    if adopted is not None:
        logger.warning("console: adopted the running console (pid %d) on port %d", adopted.pid,
                       cfg.console.port)
        return adopted
    if not _port_is_free(cfg.console.host, cfg.console.port):
        logger.warning("console not started: %s:%s is in use", cfg.console.host, cfg.console.port)
        return None
    env = child_environment({CONSOLE_SECRET_ENV: secrets.token_urlsafe(32)})
    log_dir = cfg.state_path / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "console.log", "ab") as log:
        child = subprocess.Popen(command(cfg, api_url), stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    store.kv_put(PID_KEY, child.pid)
    return ConsoleProcess(psutil.Process(child.pid), child)


def _adopt(cfg: Config, store: ConsoleStore) -> ConsoleProcess | None:
    pid = store.kv_get(PID_KEY)
    if not isinstance(pid, int):
        return None
    try:
        process = psutil.Process(pid)
        args = process.cmdline()
    except psutil.Error:
        return None
    port = str(cfg.console.port)
    ours = "dashboards" in args and "--port" in args and args[args.index("--port") + 1] == port
    return ConsoleProcess(process, None) if ours and process.status() != psutil.STATUS_ZOMBIE else None


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def stop_console(console: ConsoleProcess | None) -> None:
    if console is not None:
        console.stop()
