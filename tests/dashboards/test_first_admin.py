"""A first ``controlplane up`` with no admin password configured prints one, once, with the console's
address; that password logs in to the console (a browser's form post), and a second start prints none."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from inference.launcher import free_port
from tests.controlplane.up.conftest import (  # noqa: F401 (model_state is a fixture used by name)
    model_state,
    replica_pids,
    start,
    wait_ready,
    write_config,
)

from .conftest import console_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def announced(log: Path, pattern: str, timeout_s: float = 90.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} not announced:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def test_first_start_prints_an_admin_password_that_logs_in(model_state: Path,  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(model_state, replicas=1)
    port = free_port()
    config.write_text(config.read_text() + f"[console]\nport = {port}\n")
    monkeypatch.delenv("CONTROLPLANE_ADMIN_PASSWORD", raising=False)
    first = start(config, model_state, "admin-token-for-first-admin-test")
    try:
        url = announced(first.log, r"console: +(http://127\.0\.0\.1:\d+)").group(1)
        password = announced(first.log, r"console user admin, password \(shown once\): (\S+)").group(1)
        assert url == f"http://127.0.0.1:{port}"
        wait_ready(first, 1)
        with httpx.Client(base_url=url, trust_env=False) as browser:
            deadline = time.monotonic() + 60
            while True:
                try:
                    form = browser.get("/login")
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, "console not up"
                    time.sleep(0.5)
            csrf = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
            assert csrf is not None
            login = browser.post("/login", headers={"Origin": url}, data={
                "csrf_token": csrf.group(1), "user": "admin", "password": password})
            assert login.status_code == 302 and login.headers["location"] == "/"
            assert browser.get("/").status_code == 200
    finally:
        stop(first.process)
        leftovers = console_pids(port)
        for pid in replica_pids(first.state_dir) | leftovers:
            os.kill(pid, signal.SIGKILL)
    assert leftovers == set()

    again = start(config, model_state, "admin-token-for-first-admin-test")
    try:
        announced(again.log, r"console: ")
        assert "password (shown once)" not in again.log.read_text()
    finally:
        stop(again.process)
        for pid in replica_pids(again.state_dir) | console_pids(port):
            os.kill(pid, signal.SIGKILL)
