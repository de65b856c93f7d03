"""``controlplane up`` that cannot start says why in one line and leaves nothing behind.

Its API port taken: it fails before it starts anything. Its gateway port taken by another program: the
gateway cannot listen, and the replicas and gateways it had started are stopped again. (Before, a taken
API port was found after the replicas had started, and they were left running with no control plane.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from .conftest import console_pids_of, gateway_pids, replica_pids, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


# where this run's decode kernel was built (a replica that starts before the failure loads it from there,
# not from the default folder, where it would build it again)
_KERNEL_CACHE = {k: os.environ[k] for k in ("TORCH_EXTENSIONS_DIR",) if k in os.environ}


def _up(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controlplane", "up", "--config", str(config)],
                          capture_output=True, text=True, timeout=240,
                          env={"CONTROLPLANE_ADMIN_TOKEN": "admin-token-for-start-failures",
                               "PATH": "/usr/bin:/bin", **_KERNEL_CACHE})


def _occupy(port: int) -> socket.socket:
    """A listener on the port as another program holds it (no SO_REUSEPORT)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen(1)
    return sock


@pytest.mark.parametrize("taken", ["api", "gateway"])
def test_a_taken_port_fails_the_start_in_one_line_and_leaves_no_process(model_state: Path,
                                                                       taken: str) -> None:
    config = write_config(model_state)
    raw = tomllib.loads(config.read_text())
    state = Path(raw["state_dir"])
    blocker = _occupy(raw[taken]["port"])
    try:
        done = _up(config)
    finally:
        blocker.close()
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("controlplane: ") and str(raw[taken]["port"]) in last, done.stderr[-2000:]
    api = f"http://127.0.0.1:{raw['api']['port']}"
    assert replica_pids(state) == set() and gateway_pids(state) == set() and console_pids_of(api) == set()
