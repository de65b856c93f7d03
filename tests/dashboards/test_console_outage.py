"""The console when the control plane dies, in a real headless Chromium against a real ``controlplane up``.

- ``kill -9`` of the control plane: the banner says it is unreachable and since when, and the Overview
  keeps the replicas it last showed instead of an error; the next ``controlplane up`` adopts the same
  console, and the banner is back to normal with no new login.
- The control-plane-crash drill, run from the Drills page: the page follows it through the outage and
  shows its verdict, a pass.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.controlplane.up.conftest import gateway_pids, shutdown, start, wait_ready

from .conftest import (
    ADMIN_PASSWORD,
    Console,
    _wait_for_console,
    choose,
    console_config,
    console_pids,
    log_in,
    screenshot,
    wait_for,
    wait_text,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "admin-token-for-console-outage-tests"


@pytest.fixture(scope="module")
def outage_console(model_state: Path) -> Iterator[tuple[Console, Path]]:
    config, port = console_config(model_state)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONTROLPLANE_ADMIN_PASSWORD", ADMIN_PASSWORD)
        running = start(config, model_state, TOKEN)
    console = Console(running, f"http://127.0.0.1:{port}", port)
    try:
        wait_ready(running, 3)
        _wait_for_console(console.url, running)
        yield console, config
    finally:
        shutdown(console.running, timeout=60, leftovers=lambda: console_pids(port) | gateway_pids(
            console.running.state_dir))


def test_the_console_says_the_control_plane_is_gone_and_keeps_its_last_data(
        outage_console: tuple[Console, Path], model_state: Path, driver: WebDriver) -> None:
    console, config = outage_console
    log_in(driver, console.url, "admin", console.admin_password)
    driver.get(console.url + "/")
    wait_text(driver, "#ov-zones", r"az-b-1")
    wait_text(driver, "#banner", r"No active faults")
    [pid] = console_pids(console.port)

    console.running.process.send_signal(signal.SIGKILL)
    console.running.process.wait(10)
    down = wait_text(driver, "#banner", r"Control plane unreachable", timeout_s=30)
    assert "keep serving" in down
    time.sleep(3 * 2.0)  # three refreshes of the console (refresh_s = 2) with nobody answering
    assert "az-b-1" in driver.find_element(By.ID, "ov-zones").text  # the last data, not an error
    assert "control plane:" not in driver.find_element(By.ID, "ov-fleet-line").text
    screenshot(driver, "overview-control-plane-down", publish=True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONTROLPLANE_ADMIN_PASSWORD", ADMIN_PASSWORD)
        console.running = start(config, model_state, TOKEN)
    wait_ready(console.running, 3)
    wait_text(driver, "#banner", r"No active faults", timeout_s=60)  # the same session goes on
    assert console_pids(console.port) == {pid}  # adopted, not started again
    assert "adopted the running console" in console.running.log.read_text()


def test_the_control_plane_crash_drill_passes_from_the_drills_page(
        outage_console: tuple[Console, Path], driver: WebDriver) -> None:
    console, _ = outage_console
    restarted: int | None = None
    log_in(driver, console.url, "admin", console.admin_password)
    driver.get(console.url + "/drills")
    wait_for(driver, "#drills-scenario")
    choose(driver, "drills-scenario", "control-plane-crash: Control plane crash")
    try:
        driver.find_element(By.ID, "drills-run").click()
        started = wait_text(driver, "#drills-run-result", r"drill \d+ started: control-plane-crash")
        drill_id = int(started.split("drill ")[1].split(" ")[0])
        wait_for(driver, "#drills-done", timeout_s=300)
        verdict = driver.find_element(By.ID, "drills-verdict")
        with console.running.client() as api:
            report = api.drill(drill_id)
        restarted = report.document.get("controlplane_pid")
        screenshot(driver, "drills-control-plane-crash")
        assert report.status == "passed", report.error or [c for c in report.checks if not c.ok]
        assert verdict.get_attribute("data-status") == "passed" and verdict.text == "Verdict: PASS"
        figures = report.figures
        assert figures["requests_failed"] == 0 and figures["writes_lost"] == 0
        assert figures["faults_past_expiry"] == 0 and figures["orphans"] == 0
    finally:
        _stop(restarted)


def _stop(pid: object) -> None:
    """The control plane the drill started again is no child of the test: stop it as Ctrl-C would."""
    if not isinstance(pid, int):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(psutil.Error):
        psutil.Process(pid).wait(90)
