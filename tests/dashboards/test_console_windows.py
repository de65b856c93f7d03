"""The Autoscaler page's schedule editor in a real headless Chromium against a real ``controlplane up``.

It reuses the console module fixture of tests/dashboards/conftest.py (its autoscaler is off, which the
mode card must say) and the browser helpers of the console tests: a viewer sees the windows with every
control disabled, an admin's overlapping windows are refused with the API's message on the page, and the
windows saved next are what the API lists, with their next start, end and active flag, and audited.
"""

from __future__ import annotations

import json
import time

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from .conftest import Console, log_in, screenshot, wait_for, wait_text
from .test_console import assert_no_console_errors, rows_of
from .test_console_drills import _audit, _click, _type

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Overlapping on every day: "morning" runs 06:00-12:00 UTC and "late-morning" starts at 10:00.
OVERLAPPING = [{"name": "morning", "cron": "0 6 * * *", "duration_s": 21600},
               {"name": "late-morning", "cron": "0 10 * * *", "duration_s": 3600}]


def schedule() -> list[dict[str, object]]:
    """"current" started at the top of this hour and lasts two (active now), "later" six hours on."""
    hour = time.gmtime().tm_hour
    return [{"name": "current", "cron": f"0 {hour} * * *", "duration_s": 7200, "max_replicas": 3},
            {"name": "later", "cron": f"0 {(hour + 6) % 24} * * *", "end_cron": f"30 {(hour + 7) % 24} * * *",
             "min_replicas": 1}]


def test_schedule_editor_lists_refuses_saves_and_says_disabled(console: Console, driver: WebDriver) -> None:
    # a viewer: the schedule (none yet), the loop shown as disabled, every control of the editor disabled
    log_in(driver, console.url, "viewer", console.viewer_password)
    driver.get(console.url + "/autoscaler")
    wait_for(driver, "#as-windows #as-no-windows")
    assert wait_text(driver, "#as-mode .value", r"\w") == "disabled"  # autoscaler.enabled = false
    assert "0 window(s), from the config file; active now: none" in wait_text(
        driver, "#as-windows-source", "window")
    assert driver.find_element(By.ID, "as-windows-json").get_attribute("disabled") is not None
    assert not driver.find_element(By.ID, "as-windows-save").is_enabled()
    assert_no_console_errors(driver, "autoscaler page (viewer)")

    # an admin: overlapping windows are refused and the API's message is on the page; nothing changes
    log_in(driver, console.url, "admin", console.admin_password)
    driver.get(console.url + "/autoscaler")
    wait_for(driver, "#as-windows #as-no-windows")
    assert driver.find_element(By.ID, "as-windows-save").is_enabled()
    _type(driver, "as-windows-json", json.dumps(OVERLAPPING))
    _click(driver, "#as-windows-save")
    refused = wait_text(driver, "#as-windows-refused", "refused")
    assert refused.startswith(
        "refused: HTTP 400: windows 'morning' and 'late-morning' overlap (both active at ")
    _type(driver, "as-windows-json", "[{not json")
    _click(driver, "#as-windows-save")
    assert "not saved: the windows are not JSON" in wait_text(driver, "#as-windows-refused", "not JSON")
    with console.running.client() as api:
        assert api.autoscaler_windows().windows == ()

    # a valid schedule is saved; the table shows what the API lists
    _type(driver, "as-windows-json", json.dumps(schedule()))
    _click(driver, "#as-windows-save")
    assert wait_text(driver, "#as-windows-saved", "saved") == "saved 2 window(s): current, later"
    wait_for(driver, "#as-windows tr.window-row[data-name='later']")
    with console.running.client() as api:
        listed = api.autoscaler_windows()
        status = api.autoscaler_status()
    assert listed.source == "api" and status.windows_source == "api" and status.enabled is False
    rows = {r["name"]: r for r in rows_of(driver, "#as-windows tr.window-row")}
    assert set(rows) == {"current", "later"}
    for window in listed.windows:
        row = rows[window.name]
        assert row["active"] == str(window.active).lower()
        assert float(row["next_start"]) == window.next_start
        assert float(row["next_end"]) == window.next_end
        assert window.schedule in row["text"]
    assert listed.active == "current" and rows["current"]["active"] == "true"
    assert rows["later"]["active"] == "false"
    assert "–..3" in rows["current"]["text"] and "1..–" in rows["later"]["text"]
    assert "2 window(s), set through the console or API; active now: current" in wait_text(
        driver, "#as-windows-source", "set through")
    assert wait_text(driver, "#as-window .value", "current") == "current"  # the status card's active window
    audit = _audit(console)
    assert {("admin", "autoscaler.windows", "error"), ("admin", "autoscaler.windows", "ok")} <= audit
    screenshot(driver, "autoscaler-schedule")
    assert_no_console_errors(driver, "autoscaler page (schedule editor)")
