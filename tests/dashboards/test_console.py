"""The console in a real headless Chromium against a real ``controlplane up``: what an SRE sees and can do.

One control plane and one browser serve the whole module (tests run in file order). Every page visit
checks the browser console for errors and saves a screenshot to the test artifacts.
"""

from __future__ import annotations

import json
import math
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from controlplane.client import ApiError, ControlPlaneClient
from inference.bench.report import RequestRecord

from .conftest import (
    Console,
    button_outlives_ticks,
    choose,
    console_errors,
    console_pids,
    log_in,
    screenshot,
    wait_for,
    wait_text,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

# Every page: its path and what shows once it has rendered (a new page adds a line here).
PAGES = {"overview": ("/", ".replica-card"), "latency": ("/latency", "#lat-shares td"),
         "chaos": ("/chaos", "#chaos-catalogue tr"), "audit": ("/audit", "#audit-table tr.audit-row")}
PAGES |= {"drills": ("/drills", "#drills-history tr"), "autoscaler": ("/autoscaler", "#as-decisions tr"),
          "alerts": ("/alerts", "#al-rules tr.rule-row"), "rollouts": ("/rollouts", "#ro-versions tr")}
STAGES = ("gateway", "queue", "prefill", "decode", "serialization")


def visit(browser: WebDriver, console: Console, page: str, ready: str) -> None:
    browser.get(console.url + PAGES[page][0])
    wait_for(browser, ready)


def assert_no_console_errors(browser: WebDriver, where: str) -> None:
    errors = console_errors(browser)
    assert errors == [], f"{where}: browser console errors: {json.dumps(errors, indent=1)}"


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def plot_data(browser: WebDriver, graph_id: str) -> list[dict[str, object]]:
    """The traces plotly drew in a dcc.Graph: name, number of points, last x."""
    return browser.execute_script(  # type: ignore[no-any-return]
        "const p = document.querySelector(arguments[0] + ' .js-plotly-plot');"
        "return p && p.data ? p.data.map(t => ({name: t.name || '', n: (t.x || []).length,"
        " last: (t.x || []).length ? String(t.x[t.x.length - 1]) : ''})) : [];", f"#{graph_id}")


def replica_states(browser: WebDriver) -> dict[str, list[str]]:
    """Zone -> the states of its replica cards, as the Overview shows them now."""
    return browser.execute_script(  # type: ignore[no-any-return]
        "const out = {}; for (const z of document.querySelectorAll('.zone')) {"
        " out[z.dataset.zone] = Array.from(z.querySelectorAll('.replica-card'), c => c.dataset.state); }"
        " return out;")


def rows_of(browser: WebDriver, selector: str) -> list[dict[str, str]]:
    """Text and data-* attributes of every element matching ``selector``, read in one go."""
    return browser.execute_script(  # type: ignore[no-any-return]
        "return Array.from(document.querySelectorAll(arguments[0]),"
        " e => Object.assign({text: e.innerText}, e.dataset));", selector)


def test_login_refuses_a_wrong_password_and_admits_the_admin(console: Console, driver: WebDriver) -> None:
    driver.get(console.url + "/chaos")
    assert driver.current_url.endswith("/login")  # no session: every page sends you to log in
    driver.find_element(By.ID, "user").send_keys("admin")
    driver.find_element(By.ID, "password").send_keys("not-the-password")
    driver.find_element(By.ID, "login-submit").click()
    assert "wrong user name or password" in wait_text(driver, "#login-error", "wrong")
    screenshot(driver, "login", publish=True)
    console_errors(driver)  # the 401 of the refused login is expected here; not of the pages
    log_in(driver, console.url, "admin", console.admin_password)
    assert "admin (admin)" in driver.find_element(By.ID, "who").text
    cookie = driver.get_cookie("console_session")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    with console.running.client() as api:
        logins = [a for a in api.audit(limit=50) if a.action == "auth.login"]
    # the failed attempt is audited as anonymous (a typed name is not who acted), with "admin" as its target
    assert {(a.actor, a.target, a.outcome) for a in logins} >= {("admin", "admin", "ok"),
                                                               ("anonymous", "admin", "denied")}


def test_overview_shows_three_ready_replicas_in_three_zones_with_live_figures(
        console: Console, driver: WebDriver, load: list[RequestRecord]) -> None:
    visit(driver, console, "overview", ".replica-card")
    wait_text(driver, "#ov-fleet-line", r"3/3 replicas ready")
    zones = replica_states(driver)  # the live refresh redraws the cards: read them in one go
    assert zones == {"az-a": ["ready"], "az-b": ["ready"], "az-c": ["ready"]}
    # figures from the load just sent: E2E latency percentiles and throughput, drawn by plotly
    wait_text(driver, "#kpi-e2e .value", r"\d+ ms")
    WebDriverWait(driver, 30).until(lambda b: any(t["n"] > 0 for t in plot_data(b, "ov-throughput")))
    latency = {t["name"]: t["n"] for t in plot_data(driver, "ov-latency")}
    assert latency.get("E2E P99", 0) > 0, latency
    first = max(t["last"] for t in plot_data(driver, "ov-throughput"))
    # live: the refresh clock redraws the charts with newer points (the range ends at "now")
    WebDriverWait(driver, 30).until(lambda b: max(t["last"] for t in plot_data(b, "ov-throughput")) > first)
    # the default model is dense: the expert-load panel says so plainly, with no empty heatmap
    wait_text(driver, "#ov-experts-body[data-moe='no'] #ov-experts-note", r"the model has no experts")
    assert plot_data(driver, "ov-experts-heatmap") == []
    screenshot(driver, "overview", publish=True)
    assert_no_console_errors(driver, "overview")


def nearest_rank(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def test_latency_page_attributes_the_tail_from_the_traces_of_the_load(
        console: Console, driver: WebDriver, load: list[RequestRecord]) -> None:
    visit(driver, console, "latency", "#lat-shares td.tail-share")
    count = int(wait_text(driver, "#lat-count .value", r"^\d+$"))
    assert count == len(load)  # every request of the test's load, nothing else
    explain = driver.find_element(By.ID, "lat-explain").text
    assert "Per-stage P99s do not add up to the end-to-end P99" in explain
    page = {td["stage"]: float(td["share"]) for td in rows_of(driver, "#lat-shares td.tail-share")}

    # the same attribution, computed here from the raw traces the API stored for the load
    with console.running.client() as api:
        traces = [t for t in api.slow_traces(limit=1000) if t.error is None]
    assert len(traces) == len(load)
    threshold = nearest_rank(sorted(t.e2e_s for t in traces), 0.99)
    tail = [t for t in traces if t.e2e_s >= threshold]
    means = {"gateway": sum(t.gateway_s for t in tail) / len(tail),
             "queue": sum(t.queue_s or 0 for t in tail) / len(tail),
             "prefill": sum(t.prefill_s or 0 for t in tail) / len(tail),
             "decode": sum(t.decode_s or 0 for t in tail) / len(tail),
             "serialization": sum((t.detokenize_s or 0) + (t.serialize_s or 0) for t in tail) / len(tail)}
    total = sum(means.values())
    assert set(page) == set(STAGES)
    for stage in STAGES:
        assert page[stage] == pytest.approx(means[stage] / total, abs=1e-4), stage
    assert sum(page.values()) == pytest.approx(1.0, abs=1e-3)
    assert page["decode"] > 0 and page["prefill"] > 0  # real stage timings from the replicas
    # the slowest-requests table lists the slowest traces, slowest first
    rows = rows_of(driver, "#lat-slowest tr.trace-row")
    assert len(rows) == min(20, len(traces))
    slowest = max(traces, key=lambda t: t.e2e_s)
    assert slowest.request_id in rows[0]["text"]
    bars = {t["name"] for t in plot_data(driver, "lat-breakdown")}
    assert bars == set(STAGES)
    WebDriverWait(driver, 30).until(lambda b: any(t["n"] > 0 for t in plot_data(b, "lat-curves")))
    screenshot(driver, "latency", publish=True)
    assert_no_console_errors(driver, "latency")


def test_pause_fault_from_the_chaos_page_then_halt_all_reverts_it(console: Console,
                                                                  driver: WebDriver) -> None:
    visit(driver, console, "chaos", "#chaos-catalogue tr[data-kind]")
    with console.running.client() as api:
        catalogue = {k.kind: k for k in api.chaos_catalogue()}
    rows = {row["kind"]: row for row in rows_of(driver, "#chaos-catalogue tr[data-kind]")}
    assert set(rows) == set(catalogue)
    for kind, info in catalogue.items():  # unavailable kinds greyed, with the reason the API gives
        greyed = driver.find_element(By.CSS_SELECTOR, f"#chaos-catalogue tr[data-kind='{kind}']")
        assert ("kind-unavailable" in (greyed.get_attribute("class") or "")) == (not info.available), kind
        if not info.available:
            assert f"unavailable: {info.unavailable_reason}" in rows[kind]["text"]
    # the slice-experiments section, empty: no experiment yet, start open to an admin, nothing to abort
    wait_for(driver, "#sx-section #sx-none")
    wait_for(driver, "#sx-history #sx-no-history")
    assert driver.find_element(By.ID, "sx-start").is_enabled()
    assert not driver.find_element(By.ID, "sx-abort").is_enabled()
    choose(driver, "chaos-kind", "pause")
    choose(driver, "chaos-replicas", "az-b-1")
    duration = driver.find_element(By.ID, "chaos-duration")
    duration.clear()
    duration.send_keys("120")

    driver.find_element(By.ID, "chaos-preview").click()  # blast radius through the API's dry run
    plan = wait_text(driver, "#chaos-plan-body", r"Blast radius")
    assert "1 target(s): az-b-1" in plan and "allowed" in plan
    with console.running.client() as api:
        assert api.chaos_faults() == []  # the preview injected nothing

        driver.find_element(By.ID, "chaos-inject").click()
        wait_text(driver, "#chaos-injected", r"injected pause: #\d+ on az-b-1")
        pid = next(r.pid for r in api.fleet().replicas if r.replica_id == "az-b-1")
        assert pid is not None and process_state(pid) == "T"
        wait_for(driver, "#chaos-active tr.active-fault[data-kind='pause']")
        [row] = rows_of(driver, "#chaos-active tr.active-fault")
        assert row["kind"] == "pause" and row["target"] == "az-b-1" and re.search(r"\d+ s", row["text"])
        banner = wait_text(driver, "#banner", r"FAULT #\d+ pause on az-b-1")
        assert "1 active fault(s)" in banner
        screenshot(driver, "chaos-active-fault", publish=True)

        driver.find_element(By.ID, "halt-all").click()
        WebDriverWait(driver, 10).until(expected_conditions.alert_is_present()).accept()  # the confirm dialog
        wait_text(driver, "#halt-result", r"HALT ALL: 1 fault\(s\) reverted")
        wait_text(driver, "#banner", r"No active faults")
        wait_for(driver, "#chaos-none-active")
        assert process_state(pid) != "T"
        assert api.chaos_faults() == []
        deadline = time.monotonic() + 60
        while api.fleet().ready_replicas < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert {r.replica_id: r.state for r in api.fleet().replicas}["az-b-1"] == "ready"
        screenshot(driver, "chaos", publish=True)
        driver.find_element(By.ID, "chaos-release").click()
        wait_text(driver, "#chaos-release-result", "released")
        actions = {(a.actor.split("/")[0], a.action, a.outcome) for a in api.audit(limit=50)}
    assert {("admin", "chaos.inject", "ok"), ("admin", "chaos.halt", "ok"),
            ("admin", "chaos.release", "ok")} <= actions
    visit(driver, console, "overview", ".replica-card[data-replica='az-b-1'][data-state='ready']")
    assert_no_console_errors(driver, "chaos")


def test_a_revert_button_outlives_the_countdown_and_its_click_says_reverted(console: Console,
                                                                           driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)
    with console.running.client() as api:
        [fault] = api.chaos_inject("token_latency", duration_s=300, replicas=["az-c-1"],
                                   params={"seconds": 0.001}).faults
        assert fault.error is None and fault.id is not None, fault
        try:
            visit(driver, console, "chaos", "#chaos-catalogue tr[data-kind]")
            row = f"#chaos-active tr.active-fault[data-fault='{fault.id}']"
            revert = button_outlives_ticks(driver, f"{row} button", f"{row} td.time-left")
            revert.click()
            assert wait_text(driver, "#chaos-revert-result", "reverted") == f"fault #{fault.id} reverted"
            wait_for(driver, "#chaos-none-active")
            assert api.chaos_faults() == []
        finally:
            if api.chaos_faults():
                api.chaos_revert(fault.id)
    assert_no_console_errors(driver, "chaos revert")


def test_a_viewer_sees_the_chaos_page_but_cannot_inject(console: Console, driver: WebDriver) -> None:
    log_in(driver, console.url, "viewer", console.viewer_password)
    visit(driver, console, "chaos", "#chaos-catalogue tr[data-kind]")
    wait_text(driver, "#who", r"viewer \(viewer\)")
    wait_for(driver, "#sx-none")
    for control in ("chaos-inject", "chaos-preview", "halt-all", "chaos-release", "sx-start", "sx-abort"):
        assert not driver.find_element(By.ID, control).is_enabled(), control
    assert "may not inject" in driver.find_element(By.ID, "chaos-role-note").text
    assert "may not start or abort" in driver.find_element(By.ID, "sx-role-note").text
    screenshot(driver, "chaos-viewer")
    assert_no_console_errors(driver, "chaos as viewer")

    # the server refuses anyway: the viewer's own token, straight at the API
    with ControlPlaneClient(console.running.api, token=None) as anonymous:
        granted = anonymous.login("viewer", console.viewer_password)
    assert granted.role == "viewer"
    with ControlPlaneClient(console.running.api, token=granted.token) as viewer:
        assert viewer.chaos_faults() == []  # reading is fine
        with pytest.raises(ApiError) as refused:
            viewer.chaos_inject("pause", duration_s=10, replicas=["az-a-1"])
        assert refused.value.status == 403
        with pytest.raises(ApiError) as halted:
            viewer.chaos_halt()
        assert halted.value.status == 403
    with console.running.client() as api:
        assert api.chaos_faults() == []
        denied = [a for a in api.audit(limit=50) if a.outcome == "denied" and a.role == "viewer"]
    assert any("POST /api/v1/chaos/faults" in a.action for a in denied)


def test_an_ended_session_takes_the_browser_to_the_login_page(console: Console, driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)
    visit(driver, console, "overview", ".replica-card")
    cookie = driver.get_cookie("console_session")
    assert cookie is not None
    # the session ends behind the page's back (as when it expires): the next poll goes to the login page
    ended = httpx.post(f"{console.url}/logout", cookies={"console_session": cookie["value"]},
                       headers={"Origin": console.url}, trust_env=False)
    assert ended.status_code == 302
    WebDriverWait(driver, 20).until(lambda b: b.current_url.endswith("/login"))
    console_errors(driver)  # the refused poll's 401 is the expected trigger here


def test_audit_page_lists_who_did_what(console: Console, driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)
    visit(driver, console, "audit", "#audit-table tr.audit-row")
    seen = {(r["action"], r["outcome"]) for r in rows_of(driver, "#audit-table tr.audit-row")}
    assert {("chaos.inject", "ok"), ("chaos.halt", "ok"), ("auth.login", "denied")} <= seen
    screenshot(driver, "audit", publish=True)
    assert_no_console_errors(driver, "audit")


def test_rollouts_page_shows_no_release_yet_and_registers_a_version(console: Console,
                                                                     driver: WebDriver) -> None:
    log_in(driver, console.url, "admin", console.admin_password)  # so that it also runs alone
    visit(driver, console, "rollouts", "#ro-versions tr")
    wait_for(driver, "#ro-no-versions")
    wait_for(driver, "#ro-no-release")
    wait_for(driver, "#ro-no-history")
    assert "stable 100.0%" in wait_text(driver, "#ro-split-line", r"100\.0%")
    for control in ("ro-promote", "ro-abort", "ro-pause", "ro-resume"):  # no release to steer
        assert not driver.find_element(By.ID, control).is_enabled(), control
    assert driver.find_element(By.ID, "ro-start").is_enabled()
    with console.running.client() as api:
        model = api.fleet().model
    for field, value in (("ro-new-name", "v1"), ("ro-new-model", model), ("ro-new-notes", "what serves now")):
        driver.find_element(By.ID, field).send_keys(value)
    driver.find_element(By.ID, "ro-add").click()
    wait_text(driver, "#ro-added", r"registered v1")
    # the table is drawn again by its own callback, which the message starts: it can land after the message
    wait_for(driver, "#ro-versions tr.version-row")
    [row] = rows_of(driver, "#ro-versions tr.version-row")
    assert row["version"] == "v1" and row["current"] == "true"  # the fleet's model: the current version
    driver.find_element(By.ID, "ro-add").click()  # again: the API's refusal, as a note
    assert "already registered" in wait_text(driver, "#ro-add-refused", r"refused")
    screenshot(driver, "rollouts")
    assert_no_console_errors(driver, "rollouts")
    with console.running.client() as api:
        assert api.versions().current == "v1" and api.rollouts().release is None


def test_every_page_renders_without_browser_errors(console: Console, driver: WebDriver) -> None:
    for page, (_, selector) in PAGES.items():
        visit(driver, console, page, selector)
        time.sleep(2.5)  # one refresh tick: the live callbacks run too
        screenshot(driver, f"page-{page}")
        assert_no_console_errors(driver, page)


def test_console_posts_from_another_origin_are_refused(console: Console) -> None:
    with httpx.Client(base_url=console.url, trust_env=False, follow_redirects=False) as browser:
        form = browser.get("/login").text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', form)
        assert csrf is not None
        own = {"Origin": console.url}
        bad_token = browser.post("/login", headers=own, data={"csrf_token": "forged", "user": "admin",
                                                              "password": console.admin_password})
        assert bad_token.status_code == 400
        cross = browser.post("/login", headers={"Origin": "http://evil.example"},
                             data={"csrf_token": csrf.group(1), "user": "admin",
                                   "password": console.admin_password})
        assert cross.status_code == 403
        form = browser.get("/login").text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', form)
        assert csrf is not None
        ok = browser.post("/login", headers=own, data={"csrf_token": csrf.group(1), "user": "admin",
                                                       "password": console.admin_password})
        assert ok.status_code == 302 and ok.headers["location"] == "/"
        body = {"output": "halt-result.children", "outputs": {"id": "halt-result", "property": "children"},
                "inputs": [{"id": "halt-confirm", "property": "submit_n_clicks", "value": 1}],
                "changedPropIds": ["halt-confirm.submit_n_clicks"],
                "state": [{"id": "halt-confirm", "property": "message", "value": "x"}]}
        for headers in ({"Origin": "http://evil.example"}, {"Referer": "http://evil.example/page"}, {}):
            refused = browser.post("/_dash-update-component", json=body, headers=headers)
            assert refused.status_code == 403, headers
        with console.running.client() as api:
            assert not any(a.action == "chaos.halt" and (a.ts or 0) > time.time() - 5 for a in api.audit(20))
        allowed = browser.post("/_dash-update-component", json=body, headers=own)
        assert allowed.status_code == 200 and "HALT ALL" in allowed.text
        with console.running.client() as api:
            api.chaos_release()
        rebinding = browser.get("/login", headers={"Host": "evil.example"})
        assert rebinding.status_code == 400


def test_stopping_the_control_plane_stops_the_console(console: Console) -> None:
    process = console.running.process
    assert console_pids(console.port), "the console runs as a child of the control plane"
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0
    assert console_pids(console.port) == set()
    with pytest.raises(httpx.ConnectError):
        httpx.get(console.url + "/login", timeout=2.0, trust_env=False)
