"""The autoscaler's schedule (cron windows) through the REST API and the CLI: list them with their next
start and end, replace them (operator, audited, validated as the config file is), kept in the store across
a restart, used by the loop from its next tick. A fake clock and the fake fleet and telemetry of
tests/controlplane/test_autoscaler.py (why they are fakes is said there); the live loop is in
tests/controlplane/up/test_autoscale_live.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.autoscale.config import ScheduleWindowConfig
from controlplane.autoscale.loop import WINDOWS_KEY, Autoscaler
from controlplane.cli.main import main
from controlplane.store.database import Store
from tests.controlplane.conftest import FakeClock
from tests.in_process import InProcess

from .test_loop import MONDAY_NOON_UTC, FixedTelemetry, RecordingFleet, busy_telemetry, endpoint, make

URL = "/api/v1/autoscaler/windows"
# Monday 2026-11-30 12:00 UTC is 13:00 in Berlin: "day" (08:00-18:00 Berlin, weekdays) is active, "night"
# (18:00-08:00 Berlin) is not.
DAY = {"name": "day", "cron": "0 8 * * 1-5", "duration_s": 36000.0, "timezone": "Europe/Berlin",
       "min_replicas": 4}
NIGHT = {"name": "night", "cron": "0 18 * * *", "end_cron": "0 8 * * *", "timezone": "Europe/Berlin",
         "max_replicas": 2}


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


@pytest.fixture
def noon(clock: FakeClock) -> FakeClock:
    clock.now = MONDAY_NOON_UTC
    return clock


@pytest.fixture
def parts() -> tuple[RecordingFleet, FixedTelemetry]:
    return RecordingFleet(2, [endpoint("r1"), endpoint("r2")]), busy_telemetry()


Api = tuple[TestClient, Autoscaler, dict[str, dict[str, str]]]


def serve(store: Store, scaler: Autoscaler, heads: dict[str, dict[str, str]] | None = None,
          ) -> tuple[TestClient, dict[str, dict[str, str]]]:
    """The API on ``scaler``, with a token per role (issued once per store)."""
    tokens = TokenAuthority(store)
    services = Services(scaler.fleet, store, tokens, Auditor(store), autoscaler=scaler)  # type: ignore[arg-type]
    if heads is None:
        heads = {role.value: {"Authorization": f"Bearer {tokens.issue(role.value, role)}"} for role in Role}
    return TestClient(create_api(services)), heads


@pytest.fixture
def api(store: Store, noon: FakeClock, parts: tuple[RecordingFleet, FixedTelemetry]) -> Iterator[Api]:
    """The loop with the config's two windows, and its API."""
    fleet, telemetry = parts
    scaler = make(store, noon, fleet, telemetry, windows=[ScheduleWindowConfig(**DAY),  # type: ignore[arg-type]
                                                          ScheduleWindowConfig(**NIGHT)])  # type: ignore[arg-type]
    client, heads = serve(store, scaler)
    with client:
        yield client, scaler, heads


def test_viewer_lists_the_config_windows_with_next_start_end_and_active(api: Api) -> None:
    client, _, heads = api
    got = client.get(URL, headers=heads["viewer"])
    assert got.status_code == 200
    view = got.json()
    assert (view["source"], view["active"], view["now"]) == ("config", "day", MONDAY_NOON_UTC)
    day, night = view["windows"]
    assert day["name"] == "day" and day["active"] and day["min_replicas"] == 4 and day["max_replicas"] is None
    assert day["next_end"] == ts("2026-11-30T18:00:00+01:00")  # the current span's end
    assert day["next_start"] == ts("2026-12-01T08:00:00+01:00")  # Tuesday
    assert night["name"] == "night" and not night["active"]
    assert (night["next_start"], night["next_end"]) == (ts("2026-11-30T18:00:00+01:00"),
                                                      ts("2026-12-01T08:00:00+01:00"))
    assert day["schedule"] == "cron '0 8 * * 1-5' Europe/Berlin for 36000s"
    assert client.get(URL).status_code == 401


def test_operator_replaces_the_windows_audited_and_the_viewer_is_refused(api: Api, store: Store) -> None:
    client, scaler, heads = api
    evening = {"name": "evening", "cron": "0 20 * * *", "duration_s": 7200, "max_replicas": 1}
    refused = client.put(URL, json={"windows": [evening]}, headers=heads["viewer"])
    assert refused.status_code == 403 and refused.json()["error"]["type"]
    assert [w["name"] for w in client.get(URL, headers=heads["viewer"]).json()["windows"]] == ["day", "night"]

    ok = client.put(URL, json={"windows": [evening]}, headers=heads["operator"])
    assert ok.status_code == 200
    view = ok.json()
    assert view["source"] == "api" and view["active"] is None
    (only,) = view["windows"]
    assert (only["name"], only["timezone"], only["max_replicas"], only["active"]) == (
        "evening", "UTC", 1, False)
    assert (only["next_start"], only["next_end"]) == (ts("2026-11-30T20:00:00+00:00"),
                                                      ts("2026-11-30T22:00:00+00:00"))
    assert client.get(URL, headers=heads["viewer"]).json()["windows"] == view["windows"]
    assert client.get("/api/v1/autoscaler/status", headers=heads["viewer"]).json()["windows_source"] == "api"
    audit = store.audit(limit=1)[0]
    assert (audit.action, audit.outcome, audit.actor, audit.target) == (
        "autoscaler.windows", "ok", "operator", "autoscaler")
    assert [w["name"] for w in audit.params["windows"]] == ["evening"]
    assert [w.name for w in scaler.windows] == ["evening"]

    cleared = client.put(URL, json={"windows": []}, headers=heads["admin"])  # no window at all is a schedule
    assert cleared.status_code == 200 and cleared.json()["windows"] == [] and scaler.windows == []


@pytest.mark.parametrize(("windows", "param", "message"), [
    ([dict(DAY, cron="0 25 * * 1-5")], "windows.0.cron",
     "window 'day': cron: '0 25 * * 1-5' in 'Europe/Berlin': Error validating expression '25'"),
    ([DAY, dict(NIGHT, timezone="Mars/Olympus")], "windows.1.timezone",
     "window 'night': cron: '0 18 * * *' in 'Mars/Olympus': 'No time zone found with key Mars/Olympus'"),
    ([DAY, dict(NIGHT, end_cron="0 8 * *")], "windows.1.end_cron",
     "window 'night': end_cron: '0 8 * *' must have 5 fields"),
    ([DAY, {"name": "evening", "cron": "0 16 * * *", "end_cron": "0 22 * * *"}], "windows.0",
     "windows 'day' and 'evening' overlap (both active at 2026-11-30T16:00:00+00:00)"),
    ([DAY, dict(DAY, cron="0 3 * * *")], "windows.1", "window 'day': defined twice"),
    ([dict(DAY, min_replicas=20)], "windows.0.min_replicas", "window 'day': bounds 20..10 are empty"),
    ([dict(DAY, duration_s=0)], "windows.0.duration_s",
     "window 'day': give either duration_s > 0 or end_cron"),
    ([dict(DAY, weekdays=["someday"], cron="0 8 * * *")], "windows.0.weekdays", "window 'day': weekdays:"),
    ([dict(DAY, colour="red")], "windows.0.colour", "windows.0.colour: Extra inputs are not permitted"),
    ([dict(DAY, name="")], "windows.0.name", "windows.0.name: String should have at least 1 character"),
])
def test_bad_windows_get_400_naming_window_and_field_and_change_nothing(
        api: Api, store: Store, windows: list[dict[str, Any]], param: str, message: str) -> None:
    client, _, heads = api
    before = client.get(URL, headers=heads["viewer"]).json()
    bad = client.put(URL, json={"windows": windows}, headers=heads["operator"])
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"].startswith(message), error
    assert client.get(URL, headers=heads["viewer"]).json() == before and store.kv_get(WINDOWS_KEY) is None
    if not param.endswith(("colour", "name")) or "twice" in message:  # refusals past the request's schema
        audit = store.audit(limit=1)[0]
        assert (audit.action, audit.outcome, audit.detail) == (
            "autoscaler.windows", "error", error["message"])


def test_windows_set_through_the_api_survive_a_restart_over_the_config(
        api: Api, store: Store, noon: FakeClock, parts: tuple[RecordingFleet, FixedTelemetry]) -> None:
    client, _, heads = api
    lunch = {"name": "lunch", "cron": "30 11 * * mon-fri", "duration_s": 5400, "max_replicas": 3}
    assert client.put(URL, json={"windows": [lunch]}, headers=heads["operator"]).status_code == 200
    fleet, telemetry = parts
    restarted = make(store, noon, fleet, telemetry,  # the config file still has "day" and "night"
                     windows=[ScheduleWindowConfig(**DAY), ScheduleWindowConfig(**NIGHT)])  # type: ignore[arg-type]
    assert restarted.windows_source == "api" and [w.name for w in restarted.windows] == ["lunch"]
    assert restarted.status()["window"] == {"name": "lunch",
                                            "schedule": "cron '30 11 * * mon-fri' UTC for 5400s"}
    again, _ = serve(store, restarted, heads)
    with again:
        (only,) = again.get(URL, headers=heads["viewer"]).json()["windows"]
    assert only["active"] and only["next_end"] == ts("2026-11-30T13:00:00+00:00")


def test_the_loop_uses_new_windows_from_its_next_tick(
        store: Store, noon: FakeClock, parts: tuple[RecordingFleet, FixedTelemetry]) -> None:
    fleet, telemetry = parts
    scaler = make(store, noon, fleet, telemetry)  # no window in the config
    client, heads = serve(store, scaler)
    with client:
        first = asyncio.run(scaler.tick())
        assert first is not None and first["final"] == 3 and first["window"] is None  # engine load 1.25x
        cap = {"name": "cap", "cron": "0 12 * * *", "duration_s": 600, "max_replicas": 2}
        assert client.put(URL, json={"windows": [cap]}, headers=heads["operator"]).status_code == 200
        noon.now += 5
        capped = asyncio.run(scaler.tick())
        assert capped is not None and capped["window"]["name"] == "cap" and capped["final"] == 2
        assert "schedule window 'cap': 3 -> 2 (bounds 1..2)" in capped["clamps"]
        assert capped["outcome"] == "scaled 3 -> 2"
        noon.now += 600  # the span is over: the autoscaler's own bounds again
        after = asyncio.run(scaler.tick())
        assert after is not None and after["window"] is None and after["final"] == 3


def test_status_says_whether_the_loop_is_enabled(
        store: Store, noon: FakeClock, parts: tuple[RecordingFleet, FixedTelemetry]) -> None:
    fleet, telemetry = parts
    on = make(store, noon, fleet, telemetry).status()
    assert (on["enabled"], on["paused"], on["observe_only"], on["windows_source"]) == (
        True, False, False, "config")
    off = make(store, noon, fleet, telemetry, enabled=False, observe_only=True).status()
    assert (off["enabled"], off["observe_only"], off["mode"]) == (False, True, "observe_only")


def test_cli_lists_and_sets_windows_and_reports_bad_ones_on_one_line(
        api: Api, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    client, _, heads = api
    operator = tmp_path / "operator.token"
    operator.write_text(heads["operator"]["Authorization"].split()[1])
    operator.chmod(0o600)

    def cli(*argv: str) -> int:
        """The CLI against the in-process API (no port needed)."""
        return main(["autoscaler", "windows", *argv, "--url", "http://testserver", "--token-file",
                     str(operator)], transport=InProcess(client))

    assert cli() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "2 window(s), from the config file; active now: day"
    assert out[1] == ("day: ACTIVE; cron '0 8 * * 1-5' Europe/Berlin for 36000s; replicas 4..-; next start "
                      "2026-12-01 07:00 UTC, ends 2026-11-30 17:00 UTC")
    good = tmp_path / "windows.json"
    good.write_text(json.dumps({"windows": [{"name": "late", "cron": "0 22 * * *", "duration_s": 3600}]}))
    assert cli("--set", str(good)) == 0
    assert capsys.readouterr().out.startswith(
        "1 window(s), set through the API; active now: none\nlate: idle")
    assert cli("--json") == 0
    (late,) = json.loads(capsys.readouterr().out)["windows"]
    assert (late["name"], late["cron"], late["duration_s"], late["active"]) == (
        "late", "0 22 * * *", 3600, False)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "late", "cron": "0 22 * *", "duration_s": 3600}]))
    assert cli("--set", str(bad)) == 1  # refused by the API
    err = capsys.readouterr().err
    assert re.match(r"^controlplane: HTTP 400: window 'late': cron: '0 22 \* \*' must have 5 fields",
                    err), err
    assert err.count("\n") == 1
    bad.write_text("{not json")
    assert cli("--set", str(bad)) == 2  # a bad command line: nothing was sent
    assert capsys.readouterr().err.startswith(f"controlplane: {bad}: not JSON:")
