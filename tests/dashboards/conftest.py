"""One real ``controlplane up`` (three replicas, gateway, API, Prometheus, console) for a whole test module,
and a real headless Chromium driven through chromedriver.

The control plane's helpers come from ``tests/controlplane/up/conftest.py``; this adds the console's
port, a viewer user (hashed password in the config, as an operator would configure one), a known admin
password through ``$CONTROLPLANE_ADMIN_PASSWORD``, and a trace sample rate of 1 so that every request of
the test's load is a stored trace.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from controlplane.auth import hash_password
from inference.bench.datasets import DatasetConfig
from inference.bench.load_client import run_load
from inference.bench.load_config import LoadConfig
from inference.bench.report import RequestRecord
from inference.launcher import free_port
from tests.controlplane.up.conftest import (  # noqa: F401 (model_state is a fixture used by name)
    Running,
    model_state,
    replica_pids,
    shutdown,
    start,
    wait_ready,
    write_config,
)
from tests.polling import wait_until

ADMIN_PASSWORD = "admin-password-for-console-tests"
VIEWER_PASSWORD = "viewer-password-for-console-tests"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-first-run", "--window-size=1440,1300")
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "docs" / "screenshots"


@dataclass
class Console:
    running: Running
    url: str
    port: int
    viewer_password: str = VIEWER_PASSWORD
    admin_password: str = ADMIN_PASSWORD


def artifacts_dir() -> Path:
    path = Path(os.environ.get("ARTIFACTS_DIR") or ROOT / "tests" / "artifacts") / "console"
    path.mkdir(parents=True, exist_ok=True)
    return path


def console_config(tmp: Path) -> tuple[Path, int]:
    """The up-tests' config (autoscaler and alert actions off) with the console on a free port, a viewer
    user and every trace kept."""
    config = write_config(tmp, replicas=3)
    port = free_port()
    text = config.read_text().replace("[gateway]\n", "[gateway]\ntrace_sample_rate = 1.0\n", 1)
    viewer = f"viewer:viewer:{hash_password(VIEWER_PASSWORD)}"
    text += f'[console]\nport = {port}\nrefresh_s = 2.0\nusers = ["{viewer}"]\n'
    # The console's what-if test checks the page (its progress bar and table), not the scheduler, which
    # test_batch.py and test_simulator.py do: under SCHED_IDLE, on a CI host whose 2 cores the other
    # worker's replicas kept busy, its 1.3 s run waited 82 s for idle gaps. Nice 10 alone still yields.
    text += '[simulator]\ncpu_priority = "low"\n'
    config.write_text(text)
    return config, port


def console_pids(port: int) -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dashboards" in cmd and str(port).encode() in cmd:
            pids.add(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def console(model_state: Path) -> Iterator[Console]:  # noqa: F811 (the fixture imported above)
    config, port = console_config(model_state)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONTROLPLANE_ADMIN_PASSWORD", ADMIN_PASSWORD)
        running = start(config, model_state, "admin-token-for-console-tests")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(running, 3)
        _wait_for_console(url, running)
        yield Console(running, url, port)
    finally:
        shutdown(running, timeout=60, leftovers=lambda: console_pids(port))


def _wait_for_console(url: str, running: Running, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/login", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"console not up at {url}:\n{running.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    """A headless Chromium whose temporary files (its profile, and the singleton socket folder it leaves
    in $TMPDIR when chromedriver stops it) live in a folder removed after it quits."""
    scratch = tmp_path_factory.mktemp("chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={scratch / 'profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(CHROMEDRIVER, env={**os.environ, "TMPDIR": str(scratch)})
    browser = webdriver.Chrome(options=options, service=service)
    browser.set_page_load_timeout(60)
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(scope="module")
def load(console: Console) -> list[RequestRecord]:
    """Real load through the gateway: its traces are what the Latency page attributes."""
    cfg = LoadConfig(dataset=DatasetConfig(num_requests=48, input_len=48, output_len=12, range_ratio=0.5),
                     base_url=console.running.gateway, concurrency=6, request_timeout=120.0)
    report = asyncio.run(run_load(cfg))
    assert sum(r.status == 200 and r.error_kind is None for r in report.records) == 48, report.summary
    return report.records


# ---- browser helpers ---------------------------------------------------------------------------------
def wait_for(browser: WebDriver, selector: str, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    return WebDriverWait(browser, timeout_s).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, selector)))


def wait_text(browser: WebDriver, selector: str, pattern: str, timeout_s: float = 30.0) -> str:
    """The text of ``selector`` once it matches ``pattern`` (a regular expression)."""
    found: list[str] = []

    def matches(b: WebDriver) -> bool:
        elements = b.find_elements(By.CSS_SELECTOR, selector)
        found[:] = [e.text for e in elements]
        return any(re.search(pattern, t) for t in found)

    try:
        WebDriverWait(browser, timeout_s, ignored_exceptions=(Exception,)).until(matches)
    except Exception as exc:
        raise AssertionError(f"{selector}: no text matching {pattern!r}; saw {found!r}") from exc
    return next(t for t in found if re.search(pattern, t))


def button_outlives_ticks(browser: WebDriver, button: str, live: str, *, changes: int = 2,
                          timeout_s: float = 30.0) -> WebElement:
    """The element ``button`` names, found once, after the text of ``live`` has changed ``changes`` times:
    still on the page, not a copy drawn under the pointer (a table redrawn on each refresh tick drops the
    answer to a click made just before a tick)."""
    element = wait_for(browser, button)
    seen = [_text(browser, live)]

    def moved() -> bool:
        text = _text(browser, live)
        if text != seen[-1]:
            seen.append(text)
        return len(seen) > changes

    wait_until(moved, timeout=timeout_s, what=f"{live} to change {changes} times", interval=0.2)
    assert not expected_conditions.staleness_of(element)(browser), (
        f"{button} was drawn again while {live} went {seen}")
    return element


def _text(browser: WebDriver, selector: str) -> str | None:
    return browser.execute_script(  # type: ignore[no-any-return]
        "const e = document.querySelector(arguments[0]); return e && e.innerText;", selector)


def log_in(browser: WebDriver, url: str, user: str, password: str) -> None:
    browser.get(f"{url}/login")  # leave the page first: its polls stop
    browser.delete_all_cookies()
    browser.get(f"{url}/login")
    browser.find_element(By.ID, "user").send_keys(user)
    browser.find_element(By.ID, "password").send_keys(password)
    browser.find_element(By.ID, "login-submit").click()
    wait_text(browser, "#who", re.escape(user))


def console_errors(browser: WebDriver) -> list[dict[str, object]]:
    """SEVERE entries of the browser console since the last call (reading empties the buffer)."""
    return [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]


def screenshot(browser: WebDriver, name: str, *, publish: bool = False) -> Path:
    """Save a PNG of the page as a test artifact; ``publish``: also refresh the README's copy in
    docs/screenshots, when ``UPDATE_SCREENSHOTS=1`` (a test run never changes tracked files otherwise)."""
    path = artifacts_dir() / f"{name}.png"
    assert browser.save_screenshot(str(path)), f"screenshot {name} failed"
    if publish and os.environ.get("UPDATE_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, SCREENSHOTS / f"{name}.png")
    return path


def choose(browser: WebDriver, dropdown_id: str, text: str) -> None:
    """Pick ``text`` in a Dash 4 dropdown: open it, click the option, close it."""
    browser.find_element(By.CSS_SELECTOR, f"#{dropdown_id}").click()

    def option(b: WebDriver):  # type: ignore[no-untyped-def]
        for element in b.find_elements(By.CSS_SELECTOR, ".dash-dropdown-option"):
            if element.is_displayed() and element.text.strip() == text:
                return element
        return False

    WebDriverWait(browser, 10).until(option).click()
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    wait_text(browser, f"#{dropdown_id}", re.escape(text), timeout_s=10)
