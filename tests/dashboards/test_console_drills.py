"""The Drills, Autoscaler and Alerts pages in a real headless Chromium against a real ``controlplane up``.

This module runs its own control plane: two replicas (a crash drill needs one survivor, and the machine is
small), the autoscaler on in observe-only mode, ticking every 2 s, so its decision records are real but it
never resizes the fleet under the drill, and the alert loop on with one extra rule that fires at once (each
replica is up) and notifies (no webhook configured: the action is recorded as skipped), so the Alerts page
has firing alerts and history to show. Tests run in file order: the alerts test switches that rule off,
and the drill runs before the autoscaler tests, so the decisions they read saw its load and its crash.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from controlplane.client import ApiError, ControlPlaneClient
from tests.polling import wait_until

from .conftest import (
    ADMIN_PASSWORD,
    Console,
    _wait_for_console,
    button_outlives_ticks,
    choose,
    console_config,
    console_pids,
    log_in,
    screenshot,
    shutdown,
    start,
    wait_for,
    wait_ready,
    wait_text,
)
from .test_console import assert_no_console_errors, plot_data, rows_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPLICAS = 2
DEFAULT_RULES = {"HighErrorRate", "SlowTimeToFirstToken", "KVCacheFull", "LongQueue", "ReplicaDown"}
TEST_RULE = "ConsoleTestReplicaUp"
ALERTS = f"""[alerts]
enabled = true
eval_interval_s = 1.0
[[alerts.rules]]
name = "{TEST_RULE}"
query = "replica_up"
comparison = ">"
threshold = 0.5
for_s = 2.0
severity = "info"
action = "notify"
summary = "the replica answers its metrics scrape (fires at once, for the test)"
"""


@pytest.fixture(scope="module")
def console(model_state: Path) -> Iterator[Console]:
    """``controlplane up`` with the console, two replicas and an observe-only autoscaler."""
    config, port = console_config(model_state)
    text = config.read_text().replace("replicas = 3\n", f"replicas = {REPLICAS}\n", 1)
    text = text.replace("[autoscaler]\nenabled = false\n",
                        "[autoscaler]\nenabled = true\nobserve_only = true\ntick_s = 2.0\n", 1)
    text = text.replace("[alerts]\nenabled = false\n", ALERTS, 1)
    assert "observe_only = true" in text and f"replicas = {REPLICAS}" in text and TEST_RULE in text, text
    config.write_text(text)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONTROLPLANE_ADMIN_PASSWORD", ADMIN_PASSWORD)
        running = start(config, model_state, "admin-token-for-console-drill-tests")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(running, REPLICAS)
        _wait_for_console(url, running)
        yield Console(running, url, port)
    finally:
        shutdown(running, timeout=60, leftovers=lambda: console_pids(port))


def _type(browser: WebDriver, element_id: str, text: str) -> None:
    """Replace the text of a Dash input (``clear()`` alone is undone by React's controlled value)."""
    field = browser.find_element(By.ID, element_id)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.BACKSPACE)
    field.send_keys(text)


def _click(browser: WebDriver, selector: str) -> None:
    """Click ``selector`` in a table the refresh clock redraws (a stale element is looked up again)."""

    def clicked(b: WebDriver) -> bool:
        b.find_element(By.CSS_SELECTOR, selector).click()
        return True

    WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(clicked)


def _audit(console: Console) -> set[tuple[str, str, str]]:
    with console.running.client() as api:
        return {(a.actor.split("/")[0], a.action, a.outcome) for a in api.audit(limit=200)}


# ---- Alerts ---------------------------------------------------------------------------------------
def test_alerts_page_shows_rules_firing_alerts_and_the_actions_they_took(console: Console,
                                                                         driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)
    driver.get(console.url + "/alerts")
    wait_for(driver, "#al-rules tr.rule-row")
    rows = {r["rule"]: r for r in rows_of(driver, "#al-rules tr.rule-row")}
    assert set(rows) == DEFAULT_RULES | {TEST_RULE}  # the default rules, and the configured one
    with console.running.client() as api:
        rules = {r.name: r for r in api.alert_rules()}
    assert set(rules) == set(rows)
    for name, rule in rules.items():  # what the page shows is what the API says
        assert rows[name]["enabled"] == str(rule.enabled).lower()
        assert rule.action in rows[name]["text"] and rule.severity in rows[name]["text"]

    # the test rule fires for each replica; the history shows the transitions and the notify action
    WebDriverWait(driver, 60).until(lambda b: len(
        [a for a in rows_of(b, "#al-active tr.active-alert") if a["state"] == "firing"]) == REPLICAS)
    assert "replica=az-a-1" in driver.find_element(By.ID, "al-active").text
    wait_text(driver, "#banner", rf"{REPLICAS} firing alert\(s\)")
    wait_for(driver, f"#al-history tr.history-row[data-rule='{TEST_RULE}'][data-state='firing']")
    with console.running.client() as api:
        firing = [h for h in api.alert_history(rule=TEST_RULE) if h.state == "firing"]
    actions = [h.result for h in firing]
    assert len(firing) == REPLICAS and all(a is not None and a.outcome == "skipped" for a in actions), firing
    assert actions[0] is not None
    history = [r for r in rows_of(driver, "#al-history tr.history-row")
               if r["rule"] == TEST_RULE and r["state"] == "firing"]
    assert len(history) == REPLICAS
    assert all("notify" in r["text"] and f"skipped: {actions[0].target}" in r["text"]
               for r in history), history
    screenshot(driver, "alerts", publish=True)

    # switching the rule off from the page resolves its alerts
    _click(driver, f"#al-rules tr[data-rule='{TEST_RULE}'] button")
    wait_text(driver, "#al-switch-result", rf"{TEST_RULE} disabled; {REPLICAS} active alert\(s\) resolved")
    wait_for(driver, "#al-none-active")
    wait_for(driver, f"#al-rules tr[data-rule='{TEST_RULE}'][data-enabled='false']")
    wait_text(driver, "#banner", r"No active faults, no firing alerts")
    wait_for(driver, f"#al-history tr.history-row[data-rule='{TEST_RULE}'][data-state='resolved']")
    # and back on
    _click(driver, "#al-rules tr[data-rule='LongQueue'] button")
    wait_for(driver, "#al-rules tr[data-rule='LongQueue'][data-enabled='false']")
    _click(driver, "#al-rules tr[data-rule='LongQueue'] button")
    wait_for(driver, "#al-rules tr[data-rule='LongQueue'][data-enabled='true']")
    with console.running.client() as api:
        enabled = {r.name: r.enabled for r in api.alert_rules()}
        assert api.active_alerts() == []
    assert enabled[TEST_RULE] is False and enabled["LongQueue"] is True
    assert {("admin", "alerts.disable", "ok"), ("admin", "alerts.enable", "ok")} <= _audit(console)
    assert_no_console_errors(driver, "alerts")


def test_a_rule_switch_outlives_the_refresh_and_its_click_says_what_it_did(console: Console,
                                                                         driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)
    driver.get(console.url + "/alerts")
    row = "#al-rules tr.rule-row[data-rule='LongQueue']"
    switch = button_outlives_ticks(driver, f"{row}[data-enabled='true'] button", f"{row} td.rule-last-eval")
    switch.click()
    assert wait_text(driver, "#al-switch-result", "LongQueue") == "LongQueue disabled"
    _click(driver, f"{row}[data-enabled='false'] button")  # a new label: this row is drawn again
    assert wait_text(driver, "#al-switch-result", "enabled") == "LongQueue enabled"
    wait_for(driver, f"{row}[data-enabled='true']")
    with console.running.client() as api:
        assert {r.name: r.enabled for r in api.alert_rules()}["LongQueue"] is True
    assert_no_console_errors(driver, "alert switch")


# ---- Drills ---------------------------------------------------------------------------------------
def test_replica_crash_drill_from_the_drills_page_shows_its_report(console: Console,
                                                                   driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)  # on its own too, not after another test
    driver.get(console.url + "/drills")
    wait_for(driver, "#drills-scenario")
    wait_text(driver, "#drills-scenario", r"replica-crash")  # the first scenario is the default pick
    for field, value in (("drills-rate", "2"), ("drills-duration_s", "10"), ("drills-fault_at_s", "4"),
                         ("drills-capacity_deadline_s", "90"), ("drills-target-rto_service_s", "30")):
        _type(driver, field, value)

    driver.find_element(By.ID, "drills-preview").click()  # the dry run: resolved target and prediction
    plan = wait_text(driver, "#drills-plan-body", r"Dry run of replica-crash")
    assert "2.0 req/s for 10.0 s" in plan and re.search(r"kill .* on az-\w-1: allowed", plan), plan
    assert "Predicted RTO service" in plan
    with console.running.client() as api:
        assert api.drills() == []  # the preview ran nothing

        driver.find_element(By.ID, "drills-run").click()
        started = wait_text(driver, "#drills-started", r"drill \d+ started: replica-crash")
        drill_id = int(re.search(r"drill (\d+)", started).group(1))  # type: ignore[union-attr]
        wait_for(driver, "#drills-running progress")  # live progress while it runs
        screenshot(driver, "drills-running")
        wait_for(driver, "#drills-done", timeout_s=240)
        report = api.drill(drill_id)
    assert report.status in ("passed", "failed"), report.error
    assert report.document["config"]["rate"] == 2 and report.document["config"]["duration_s"] == 10
    assert {c.name: c.target for c in report.checks}["rto_service_s"] == 30

    verdict = driver.find_element(By.ID, "drills-verdict")
    assert verdict.get_attribute("data-status") == report.status
    assert verdict.text == f"Verdict: {'PASS' if report.status == 'passed' else 'FAIL'}"
    shown = {r["figure"]: r for r in rows_of(driver, "#drills-figures tr.figure-row")}
    figures = report.figures
    for name in ("rto_service_s", "rto_capacity_s", "requests_failed", "tokens_lost", "writes_lost"):
        assert name in shown, name
        measured = figures[name]
        assert shown[name]["measured"] == str(measured), (name, shown[name], measured)
    assert figures["rto_service_s"] is not None and figures["requests_total"] > 0
    assert shown["rto_service_s"]["predicted"] == str(report.prediction["rto_service_s"])
    assert "<= 30" in shown["rto_service_s"]["text"]
    # the timeline: the report's series and a marker line per measured t_*
    traces = {t["name"]: t["n"] for t in plot_data(driver, "drills-timeline")}
    assert traces["sent (req/s)"] == len(report.timeline["t"]) > 0
    assert traces["ready replicas"] == len(report.timeline["ready"]) > 0
    marks = driver.execute_script(
        "const p = document.querySelector('#drills-timeline .js-plotly-plot');"
        "return (p.layout.annotations || []).map(a => a.text);")
    expected = ["t0"] + [m for m in ("t_detect", "t_switch", "t_first_ok", "t_slo", "t_capacity")
                         if figures.get(m) is not None]
    assert sorted(marks) == sorted(expected)
    [row] = [r for r in rows_of(driver, "#drills-history tr.drill-row") if r["drill"] == str(drill_id)]
    assert row["status"] == report.status
    screenshot(driver, "drills", publish=True)
    assert_no_console_errors(driver, "drills")
    assert ("admin", "drill.run", "ok") in _audit(console)


def test_a_drill_aborted_from_the_page_is_compared_with_the_first(console: Console,
                                                                  driver: WebDriver) -> None:
    driver.get(console.url + "/drills")
    wait_for(driver, "#drills-done")  # the page opens on the newest drill
    # Long enough that the abort always finds it running, also on a slow machine (a 10 s drill had ended
    # on a busy one before the abort reached it, and the page said "refused"); the abort ends it early.
    for field, value in (("drills-rate", "2"), ("drills-duration_s", "120"), ("drills-fault_at_s", "4")):
        _type(driver, field, value)
    driver.find_element(By.ID, "drills-run").click()
    started = wait_text(driver, "#drills-started", r"drill \d+ started")
    second = int(re.search(r"drill (\d+)", started).group(1))  # type: ignore[union-attr]
    driver.find_element(By.ID, "drills-abort").click()
    wait_text(driver, "#drills-aborting", rf"drill {second}: aborting")
    wait_for(driver, "#drills-done[data-status='aborted']", timeout_s=60)
    with console.running.client() as api:
        first, aborted = sorted(api.drills(), key=lambda d: d.id)
        assert aborted.id == second and aborted.status == "aborted"
        assert api.chaos_faults() == []  # an aborted drill leaves no fault behind
        expected = api.drill_compare([first.id, second])
    assert ("admin", "drill.abort", "ok") in _audit(console)

    choose(driver, "drills-compare-ids", f"#{first.id} replica-crash ({first.status})")
    choose(driver, "drills-compare-ids", f"#{second} replica-crash (aborted)")
    driver.find_element(By.ID, "drills-compare").click()
    table = wait_for(driver, "#drills-compare-table")
    header = table.find_elements(By.TAG_NAME, "th")
    assert [h.text for h in header][1:] == [f"#{c.id} {c.scenario} ({c.status})" for c in expected.columns]
    rto = next(r for r in expected.rows if r.figure == "rto_service_s")
    rows = rows_of(driver, "#drills-compare-table tr")
    line = next(r["text"] for r in rows if r["text"].startswith(rto.label + "\t"))
    assert rto.values[0] is not None
    assert f"{rto.values[0]:.3f} s" in line and "–" in line  # measured in the first, not in the aborted
    assert_no_console_errors(driver, "drill comparison")


def test_drill_schedules_are_created_edited_paused_and_deleted(console: Console, driver: WebDriver) -> None:
    with console.running.client() as api:
        aimed = max(api.fleet().replicas, key=lambda r: r.replica_id)  # not the first: a real choice
    log_in(driver, console.url, "admin", console.admin_password)  # also when run on its own (-k)
    driver.get(console.url + "/drills")
    wait_for(driver, "#drills-schedules tr")
    _type(driver, "drills-sched-name", "weekly-crash")
    _type(driver, "drills-sched-cron", "0 3 * * 1")
    _type(driver, "drills-sched-rate", "2")
    choose(driver, "drills-sched-replica", f"{aimed.replica_id} ({aimed.zone})")
    driver.find_element(By.ID, "drills-sched-create").click()
    wait_text(driver, "#drills-sched-result", r"schedule weekly-crash created; next run \d{4}-")
    wait_for(driver, "#drills-schedules tr[data-name='weekly-crash'][data-paused='false']")
    [row] = rows_of(driver, "#drills-schedules tr[data-name='weekly-crash']")
    assert row["aim"] == f"{aimed.replica_id}; rate 2/s" and f"{aimed.replica_id}; rate 2/s" in row["text"]
    with console.running.client() as api:
        [schedule] = api.drill_schedules()
        assert (schedule.scenario_id, schedule.cron, schedule.overrides) == (
            "replica-crash", "0 3 * * 1", {"rate": 2.0, "replicas": [aimed.replica_id]})

        # the form still holds what was created: a cron of its own first, so that the wait below sees the
        # pick's answer land (a pick answered after the typing below would put the stored cron back)
        _type(driver, "drills-sched-cron", "5 5 * * 5")
        choose(driver, "drills-sched-pick", "weekly-crash")
        WebDriverWait(driver, 10).until(
            lambda b: b.find_element(By.ID, "drills-sched-cron").get_attribute("value") == "0 3 * * 1")
        wait_text(driver, "#drills-sched-replica", re.escape(aimed.replica_id))  # the form shows the aim
        _type(driver, "drills-sched-cron", "30 4 * * 2")
        driver.find_element(By.ID, "drills-sched-save").click()
        wait_text(driver, "#drills-sched-result", r"schedule weekly-crash saved")
        saved = api.drill_schedule(schedule.id)
        assert (saved.cron, saved.overrides) == ("30 4 * * 2", {"rate": 2.0, "replicas": [aimed.replica_id]})

        _click(driver, "#drills-schedules tr[data-name='weekly-crash'] button")
        wait_for(driver, "#drills-schedules tr[data-name='weekly-crash'][data-paused='true']")
        assert api.drill_schedule(schedule.id).paused is True
        screenshot(driver, "drills-schedules")

        buttons = rows_of(driver, "#drills-schedules tr[data-name='weekly-crash'] button")
        assert [b["text"] for b in buttons] == ["Resume", "Delete"]
        _click(driver, "#drills-schedules tr[data-name='weekly-crash'] button:nth-of-type(2)")
        wait_for(driver, "#drills-no-schedule")
        assert api.drill_schedules() == []
        with pytest.raises(ApiError) as gone:
            api.drill_schedule(schedule.id)
        assert gone.value.status == 404
    verbs = ("create", "edit", "pause", "delete")
    assert {("admin", f"drill.schedule.{verb}", "ok") for verb in verbs} <= _audit(console)
    assert_no_console_errors(driver, "drill schedules")


@contextmanager
def _banner_countdown(api: ControlPlaneClient) -> Iterator[str]:
    """The banner's countdown of a harmless fault, what shows the refresh ticking on the Drills page (nothing
    in a schedule's or a drill's row moves by itself)."""
    [fault] = api.chaos_inject("token_latency", duration_s=300, replicas=["az-a-1"],
                               params={"seconds": 0.001}).faults
    assert fault.id is not None and fault.error is None, fault
    try:
        yield "#banner .banner-fault"
    finally:
        if api.chaos_faults():
            api.chaos_revert(fault.id)


def test_a_schedule_button_outlives_the_refresh_and_its_click_says_paused(console: Console,
                                                                        driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)
    with console.running.client() as api:
        schedule = api.add_drill_schedule(name="monthly-crash", scenario_id="replica-crash", cron="0 3 1 * *")
        try:
            with _banner_countdown(api) as ticking:
                driver.get(console.url + "/drills")
                row = "#drills-schedules tr.schedule-row[data-name='monthly-crash']"
                pause = button_outlives_ticks(driver, f"{row}[data-paused='false'] button", ticking)
                pause.click()
                assert wait_text(driver, "#drills-sched-result", "paused") == "schedule monthly-crash: paused"
            wait_for(driver, f"{row}[data-paused='true']")
            assert wait_text(driver, f"{row} td.schedule-next", "paused") == "paused"
            assert api.drill_schedule(schedule.id).paused is True
        finally:
            api.delete_drill_schedule(schedule.id)
    assert_no_console_errors(driver, "schedule pause")


def test_a_history_show_button_outlives_the_refresh_and_shows_its_drill(console: Console,
                                                                       driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)
    with console.running.client() as api:
        first, *later = sorted(d.id for d in api.drills())
        assert later, "the drill tests above leave two drills"
        with _banner_countdown(api) as ticking:
            driver.get(console.url + "/drills")
            wait_text(driver, "#drills-done", rf"^Drill {max(later)} ")  # the page opens on the newest
            show = button_outlives_ticks(driver, f"#drills-history tr.drill-row[data-drill='{first}'] button",
                                         ticking)
            show.click()
            wait_text(driver, "#drills-done", rf"^Drill {first} \(replica-crash\)")
    assert_no_console_errors(driver, "history show")


# ---- Autoscaler -----------------------------------------------------------------------------------
def test_autoscaler_page_shows_the_decisions_with_their_reasons(console: Console, driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)
    driver.get(console.url + "/autoscaler")
    wait_for(driver, "#as-decisions tr.decision-row", timeout_s=60)
    wait_text(driver, "#as-mode", r"observe_only")
    rows = rows_of(driver, "#as-decisions tr.decision-row")
    with console.running.client() as api:
        decisions = api.autoscaler_decisions(limit=200)
    assert decisions, "the autoscaler recorded no decision"
    # the drill's load reached the loop's inputs (it ran while the autoscaler observed)
    assert any((d.inputs.request_rate or 0) > 0 for d in decisions), [d.inputs for d in decisions]
    by_id = {str(d.id): d for d in decisions}
    assert rows[0]["id"] in by_id
    for row in rows:  # every listed decision is a stored record, with its reasons: observe-only, not applied
        record = by_id[row["id"]]
        assert row["mode"] == "observe_only" and row["applied"] == "false" and "observe only" in row["text"]
        assert row["final"] == str(record.final)
        assert record.proposals and all(f"{p.source} -> {p.replicas}: {p.reason}" in row["text"]
                                        for p in record.proposals)
        assert all(c in row["text"] for c in record.clamps)
    # how the replicas ran against their profile, and the share of their step time on a core, at the last
    # decision (or why it could not be told) (read as the page refreshes the cards: wait_text retries an
    # element replaced under it)
    shown = (r"^(\d+\.\d\dx, \d+% on a core( \(stale: run controlplane calibrate\))?"
             r"|– \(replicas too idle to judge\))$")
    wait_text(driver, "#as-drift .value", shown)
    # the chart: replicas and load over time from the same records
    WebDriverWait(driver, 30).until(
        lambda b: {t["name"]: t["n"] for t in plot_data(b, "as-timeline")}.get("replicas (current)", 0) > 0)
    names = {t["name"] for t in plot_data(driver, "as-timeline")}
    assert {"load (req/s)", "replicas (current)", "replicas (decided)"} <= names
    screenshot(driver, "autoscaler", publish=True)
    assert_no_console_errors(driver, "autoscaler")


def test_autoscaler_policy_editor_and_pause_change_the_live_loop(console: Console,
                                                                 driver: WebDriver) -> None:
    driver.get(console.url + "/autoscaler")
    wait_for(driver, "#as-status .card")
    _type(driver, "as-max_replicas", "9")
    driver.find_element(By.ID, "as-save").click()
    wait_text(driver, "#as-save-result", r"saved: mode observe_only, replicas \d+\.\.9")
    with console.running.client() as api:
        status = api.autoscaler_status()
        assert status.config.max_replicas == 9 and status.observe_only is True
        driver.find_element(By.ID, "as-pause").click()
        wait_text(driver, "#as-save-result", r"paused: mode paused")
        wait_text(driver, "#as-mode", r"paused")
        assert api.autoscaler_status().mode == "paused"
        driver.find_element(By.ID, "as-resume").click()
        wait_text(driver, "#as-save-result", r"resumed: mode observe_only")
        assert api.autoscaler_status().mode == "observe_only"
    assert {("admin", "autoscaler.config", "ok"), ("admin", "autoscaler.pause", "ok"),
            ("admin", "autoscaler.resume", "ok")} <= _audit(console)
    assert_no_console_errors(driver, "autoscaler editor")


SIM_TRACE_S = 7200  # two hours of the bursty trace: 1.3 s of simulation on a quiet machine, 4 polls


def _sim_progress(browser: WebDriver) -> list[Any]:
    """[fraction, policy] of the progress bar shown now (None when there is none), and the table's rows."""
    return browser.execute_script(  # type: ignore[no-any-return]
        "const r = document.querySelector('#as-sim-progress #as-sim-running');"
        "return [r && r.querySelector('progress') ? r.dataset.fraction : null, r ? r.dataset.policy : null,"
        " document.querySelectorAll('#as-sim-table tr.sim-row').length];")


def test_what_if_simulator_compares_policies_on_a_trace(console: Console, driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)  # also when run on its own (-k)
    driver.get(console.url + "/autoscaler")
    wait_for(driver, "#as-sim-run")
    _type(driver, "as-sim-duration", str(SIM_TRACE_S))
    _type(driver, "as-sim-compress", "1")
    driver.find_element(By.ID, "as-sim-run").click()

    # the run is a job in the control plane: the page polls it and shows a progress bar, then the table
    seen: list[tuple[float, str]] = []

    def table_drawn() -> bool:
        fraction, policy, rows = _sim_progress(driver)
        if fraction is not None:
            seen.append((float(fraction), str(policy)))
        return bool(rows)

    wait_until(table_drawn, timeout=180, what="the simulation's table", interval=0.1)
    assert seen, "no progress bar was shown before the table"
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and any(0.0 < f < 1.0 for f in fractions), seen
    assert {p for _, p in seen} <= {"ours", "hpa"} and seen[0][1] == "ours", seen
    assert _sim_progress(driver)[0] is None  # the bar goes when the result is drawn

    rows = {r["policy"]: r for r in rows_of(driver, "#as-sim-table tr.sim-row")}
    assert set(rows) == {"ours", "hpa"}
    for row in rows.values():
        assert 0.0 <= float(row["worst"]) <= float(row["slo"]) <= 1.0  # the worst 5 minutes, then the run
        # every request that missed is in a count: past TTFT, past TPOT, or not finished
        missed = int(row["missed_ttft"]) + int(row["missed_tpot"]) + int(row["unfinished"])
        assert (missed > 0) == (float(row["slo"]) < 1.0)
    note = driver.find_element(By.ID, "as-sim-note").text
    assert re.search(r"\d+ requests of the synthetic-bursty trace", note), note
    # which profile the result came from, and how well it fits its held-out points
    assert re.search(r"replica profile: .+ \((shipped|/\S+\.json); fit error .+ held out\)", note), note
    traces = {t["name"]: t["n"] for t in plot_data(driver, "as-sim-graph")}
    assert traces.get("ours replicas", 0) > 0 and traces.get("hpa replicas", 0) > 0, traces
    with console.running.client() as api:
        audit = api.audit(limit=50)
        jobs = api.simulations(limit=1)
    runs = [a for a in audit if a.action == "simulate.run"]
    assert runs and runs[0].outcome == "ok" and runs[0].params["duration_s"] == SIM_TRACE_S
    starts = [a for a in audit if a.action == "simulate.start"]
    assert starts and starts[0].outcome == "ok" and starts[0].detail == f"simulation {jobs[0].id}"
    progress = jobs[0].progress
    assert jobs[0].status == "done" and progress is not None and progress.fraction == 1.0
    screenshot(driver, "autoscaler-what-if")
    assert_no_console_errors(driver, "what-if")


# ---- a viewer -------------------------------------------------------------------------------------
VIEWER_DISABLED = {
    "drills": ("/drills", "#drills-history tr.drill-row",
               ("drills-preview", "drills-run", "drills-abort", "drills-sched-create", "drills-sched-save")),
    "autoscaler": ("/autoscaler", "#as-decisions tr.decision-row",
                   ("as-save", "as-pause", "as-resume", "as-sim-run", "as-max_replicas", "as-min_replicas")),
    "alerts": ("/alerts", "#al-rules tr.rule-row", ()),
}


def test_a_viewer_sees_the_pages_with_every_mutating_control_disabled(console: Console,
                                                                      driver: WebDriver) -> None:
    log_in(driver, console.url, "viewer", console.viewer_password)
    for page, (path, ready, controls) in VIEWER_DISABLED.items():
        driver.get(console.url + path)
        wait_for(driver, ready)
        wait_text(driver, "#who", r"viewer \(viewer\)")
        for control in (*controls, "halt-all"):
            assert not driver.find_element(By.ID, control).is_enabled(), (page, control)
        time.sleep(2.5)  # one refresh tick: the live callbacks run as the viewer too
        screenshot(driver, f"{page}-viewer")
        assert_no_console_errors(driver, f"{page} as viewer")
    switches = driver.find_elements(By.CSS_SELECTOR, "#al-rules tr.rule-row button")
    assert len(switches) == len(DEFAULT_RULES) + 1 and not any(b.is_enabled() for b in switches)
    assert "may not switch rules" in driver.find_element(By.ID, "al-role-note").text

    # the server refuses anyway: the viewer's own token, straight at the API
    with ControlPlaneClient(console.running.api, token=None) as anonymous:
        token = anonymous.login("viewer", console.viewer_password).token
    with ControlPlaneClient(console.running.api, token=token) as viewer:
        assert viewer.drills()  # reading is fine
        for refused in (lambda: viewer.drill_plan("replica-crash"),
                        lambda: viewer.set_alert_rule("LongQueue", enabled=False),
                        lambda: viewer.autoscaler_configure(max_replicas=4),
                        lambda: viewer.simulate(duration_s=60)):
            with pytest.raises(ApiError) as denied:
                refused()
            assert denied.value.status == 403
