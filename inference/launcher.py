"""Start one replica as a child process and wait until it is ready (used by benchmarks and tests).

The control plane's process backend manages fleets; this is the small single-replica version: spawn
``python -m inference serve`` (or fork it from a :class:`~inference.forkserver.ForkServer`, as the fleet
does), poll ``/ready`` with a deadline, and always stop what was started.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from inference.cpu_limit import sweep
from inference.environment import child_environment
from inference.forkserver import ForkedProcess, ForkServer, still_running


def unwind_on_sigterm() -> None:
    """SIGTERM unwinds the main thread as Ctrl-C does (``KeyboardInterrupt``), so that the ``finally``
    blocks that stop child processes run: a benchmark stopped by ``kill`` or a CI timeout leaves no
    replica behind. Call it from the main thread of a command that starts replicas."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and not handed out by this process before: the kernel may give a port just closed
    to the next ``bind(0)``, and a configuration of several listeners written with one call each would then
    name one port twice (a clean-clone run saw a gateway refused its port, Prometheus' own)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free port on {host} that this process had not handed out already")


def replica_environment(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """The environment a replica process starts with: ours without its secrets
    (:func:`~inference.environment.child_environment`), plus ``extra``, plus passive OpenMP waiting.

    A replica shares CPU cores with other replicas, the gateway and the control plane. OpenMP workers
    that spin between parallel regions (libgomp's default) burn cores the others need, which shows as
    latency added everywhere else. An explicit ``OMP_WAIT_POLICY`` wins.
    """
    return {"OMP_WAIT_POLICY": "PASSIVE", **child_environment(extra)}


@dataclass
class ReplicaProcess:
    port: int
    replica_id: str = "replica-0"
    zone: str = "local"
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    forkserver: ForkServer | None = None  # fork it from this (as the fleet does) instead of exec'ing it
    process: subprocess.Popen[bytes] | ForkedProcess | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ReplicaProcess:
        cmd = [sys.executable, "-m", "inference", "serve", "--port", str(self.port),
               "--replica-id", self.replica_id, "--zone", self.zone, *self.extra_args]
        env = replica_environment(self.env)
        if self.forkserver is not None:
            self.process = self.forkserver.spawn(cmd[3:], env, self.log_path)
        elif self.log_path is None:
            self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
        else:
            with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
                self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and not still_running(self.process):
                raise RuntimeError(f"replica {self.replica_id} exited with {self.process.returncode} "
                                   f"before it was ready{self._log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"replica {self.replica_id} not ready after {timeout:g}s{self._log_tail()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after ``timeout``; returns the exit status."""
        if self.process is None or not still_running(self.process):
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGKILL)
            return self.process.wait()

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])

    def __enter__(self) -> ReplicaProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        sweep()  # the CPU limit's group of a replica that had to be killed (``--cpu-limit``)
