"""``python -m dashboards`` as a process: it serves the login page, and it goes on serving when the process
that started it dies (a control plane killed with -9): its users keep the last data and a banner that says
the control plane is gone, and the next ``controlplane up`` adopts it (``tests/dashboards/
test_console_outage.py``). SIGTERM stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from inference.launcher import free_port

pytestmark = [pytest.mark.timeout(120)]


def is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"  # exited; its new parent has not reaped it yet


def test_the_console_outlives_its_parent_and_stops_on_sigterm() -> None:
    port = free_port()
    launcher = ("import subprocess, sys, time\n"
                f"child = subprocess.Popen([sys.executable, '-m', 'dashboards', '--port', '{port}',"
                " '--api', 'http://127.0.0.1:9'], start_new_session=True)\n"
                "print(child.pid, flush=True)\n"
                "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    console = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                login = httpx.get(f"http://127.0.0.1:{port}/login", timeout=1.0, trust_env=False)
                if login.status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("the console did not serve its login page")
        parent.kill()
        parent.wait(10)
        time.sleep(3.0)  # the old console watched its parent every second and quit
        assert httpx.get(f"http://127.0.0.1:{port}/login", timeout=5.0, trust_env=False).status_code == 200
        os.kill(console, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while not is_gone(console) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert is_gone(console)
    finally:
        if not is_gone(console):
            os.kill(console, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
