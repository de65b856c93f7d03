"""``controlplane``'s conventions, against the control plane's API in this process: ``--version``; ``--url``
and ``--token`` before the command or after it; ``--json`` on every listing and status command, with the
same data as its table; one line on stderr for an error, and the exit code that says what happened (0 done,
1 refused or failed, 2 usage, 3 the control plane cannot be reached)."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from controlplane import __version__
from controlplane.cli.main import main, parser
from controlplane.client import ControlPlaneClient

from .conftest import URL, Api

Capture = pytest.CaptureFixture[str]


def run(api: Api, *argv: str, role: str = "operator") -> int:
    return main(api.argv(*argv, role=role), transport=api.transport)


def client(api: Api) -> ControlPlaneClient:
    return ControlPlaneClient(URL, api.tokens["operator"], transport=api.transport)


# ---- version, help --------------------------------------------------------------------------------
def test_version_prints_the_installed_version(capsys: Capture) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"controlplane {__version__}\n"


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["drill", "schedule", "list", "--help"]])
def test_help_documents_the_exit_codes(argv: list[str], capsys: Capture) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog
    assert "exit codes: 0 done; 1 refused or failed" in text
    assert "2 usage" in text and "3 the control plane cannot be reached at --url" in text


def _every_parser(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...],
                                                                                      argparse.ArgumentParser]]:
    found = [(path, p)]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _every_parser(sub, (*path, name))
    return found


def test_every_commands_help_renders() -> None:
    """`--help` of every command and action (argparse %-formats help strings: a bare "%" breaks it)."""
    parsers = _every_parser(parser())
    assert len(parsers) > 40  # the walk reached the nested actions
    for path, p in parsers:
        assert p.format_help().startswith("usage: controlplane"), " ".join(path)


# ---- --url and --token --------------------------------------------------------------------------------
def test_url_and_token_go_after_the_command_too(api: Api, capsys: Capture) -> None:
    token = api.tokens["viewer"]
    assert main(["status", "--url", URL, f"--token={token}"], transport=api.transport) == 0
    assert "3/3 replicas ready" in capsys.readouterr().out
    assert main(["drill", "schedule", "list", "--url", URL, f"--token={token}"], transport=api.transport) == 0
    assert capsys.readouterr().out == "no drill schedules\n"
    assert main(["--url", URL, "alerts", f"--token={token}", "list"], transport=api.transport) == 0  # between
    assert capsys.readouterr().out.startswith("RULE ")


def test_a_token_after_the_command_replaces_the_one_before(api: Api, capsys: Capture) -> None:
    assert run(api, "status", "--token", "not-a-token") == 1
    warning, err = capsys.readouterr().err.split("\n", 1)  # a token as an argument is warned about (ps)
    assert warning.startswith("warning: --token on the command line")
    assert err.startswith("controlplane: HTTP 401: ") and err.count("\n") == 1


def test_the_url_after_the_command_wins_and_an_unreachable_one_exits_3(capsys: Capture) -> None:
    code = main(["--url", "http://127.0.0.1:7", "status", "--url", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 3
    assert err.startswith("controlplane: cannot reach the control plane at http://127.0.0.1:9") and \
        err.count("\n") == 1, err


# ---- --json: the same data as the table ----------------------------------------------------------------
@dataclass(frozen=True)
class Listing:
    argv: tuple[str, ...]
    keys: Callable[[Any], list[str]]  # what identifies each item in the JSON; each is on its table row
    header: int = 1  # table lines before the rows


LISTINGS = [
    Listing(("status",), lambda j: [r["replica_id"] for r in j["replicas"]], header=2),
    Listing(("chaos", "catalogue"), lambda j: [k["kind"] for k in j]),
    Listing(("chaos", "list"), lambda j: [f"{f['id']} {f['kind']}" for f in j]),
    Listing(("alerts", "list"), lambda j: [r["name"] for r in j]),
    Listing(("alerts", "active"), lambda j: [a["key"] for a in j]),
    Listing(("alerts", "history"), lambda j: [a["key"] for a in j]),
    Listing(("drill", "list"), lambda j: [f"{d['id']} {d['scenario']}" for d in j]),
    Listing(("drill", "schedule", "list"), lambda j: [s["id"] for s in j]),
]


@pytest.fixture
def busy(api: Api) -> Api:
    """Something to list everywhere: an active fault, a firing alert (from Alertmanager's webhook), a
    finished drill, a schedule and an autoscaler decision."""
    with client(api) as operator:
        operator.chaos_inject("record", duration_s=600, replicas=["az-b-1"])
        operator.add_drill_schedule(name="nightly", scenario_id="replica-crash", cron="0 3 * * *")
    started = dt.datetime.now(dt.UTC).isoformat()
    alert = {"status": "firing", "labels": {"alertname": "QueueBuilds", "replica": "az-a-1"},
             "annotations": {"summary": "queue builds up"}, "startsAt": started, "fingerprint": "f1"}
    with httpx.Client(transport=api.transport, base_url=URL,
                      headers={"Authorization": f"Bearer {api.tokens['operator']}"}) as http:
        answer = http.post("/api/v1/alerts/webhook", json={"version": "4", "status": "firing",
                                                          "alerts": [alert]})
        assert answer.status_code == 200, answer.text
    api.store.add_record("drills", {"scenario": "replica-crash", "status": "passed", "started_at": 1.0e9,
                                    "figures": {"rto_service_s": 0.42, "requests_failed": 0}},
                         key="replica-crash")
    asyncio.run(api.autoscaler.tick())
    return api


@pytest.mark.parametrize("listing", LISTINGS, ids=lambda c: " ".join(c.argv))
def test_json_prints_the_same_items_as_the_table(busy: Api, listing: Listing, capsys: Capture) -> None:
    assert run(busy, *listing.argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert run(busy, *listing.argv, "--json") == 0
    keys = listing.keys(json.loads(capsys.readouterr().out))
    rows = table[listing.header:]
    assert keys and len(rows) == len(keys), (table, keys)
    for key in keys:
        assert any(" ".join(key.split()) in " ".join(row.split()) for row in rows), (key, table)


def test_json_of_the_autoscaler_status_is_the_status_the_table_summarises(busy: Api, capsys: Capture) -> None:
    assert run(busy, "autoscaler", "status") == 0
    table = capsys.readouterr().out
    assert run(busy, "autoscaler", "status", "--json") == 0
    status = json.loads(capsys.readouterr().out)
    config, last = status["config"], status["last_decision"]
    assert table.startswith(f"mode {status['mode']}; desired replicas {status['desired_replicas']}; bounds "
                            f"{config['min_replicas']}..{config['max_replicas']}; ")
    assert f"{last['outcome']} (final {last['final']})" in table
    assert all(p["reason"] in table for p in last["proposals"])


def test_json_of_a_listing_is_a_list_even_when_empty(api: Api, capsys: Capture) -> None:
    assert run(api, "chaos", "list") == 0
    assert capsys.readouterr().out == "no active faults\n"
    assert run(api, "chaos", "list", "--json") == 0
    assert json.loads(capsys.readouterr().out) == []


# ---- exit codes --------------------------------------------------------------------------------------
def test_a_refusal_of_the_api_exits_1_with_its_message_on_one_line(api: Api, capsys: Capture) -> None:
    assert run(api, "alerts", "disable", "NoSuchRule") == 1
    assert capsys.readouterr().err == "controlplane: HTTP 404: no alert rule named 'NoSuchRule'\n"
    assert run(api, "chaos", "halt") == 0
    capsys.readouterr()
    assert run(api, "chaos", "inject", "record", "--replica", "az-a-1") == 1  # a conflict: halted
    err = capsys.readouterr().err
    assert err.startswith("controlplane: HTTP 409: halted") and err.count("\n") == 1, err
    assert run(api, "scale", "2", role="viewer") == 1  # forbidden
    assert capsys.readouterr().err.startswith("controlplane: HTTP 403: ")
    assert api.fleet.desired_total == 3


def test_a_bad_command_line_exits_2_and_sends_nothing(api: Api, capsys: Capture) -> None:
    assert run(api, "chaos", "inject", "record", "--param", "oops") == 2
    assert capsys.readouterr().err == "controlplane: --param: expected NAME=VALUE, got 'oops'\n"
    assert run(api, "drill", "compare", "1") == 2
    assert capsys.readouterr().err == "controlplane: compare: give at least two drill ids\n"
    assert not [a for a in api.store.audit() if a.action.startswith(("chaos.", "drill."))]
    with pytest.raises(SystemExit) as unknown:
        main(["status", "--no-such-option"])
    assert unknown.value.code == 2


def test_done_exits_0(api: Api, capsys: Capture) -> None:
    assert run(api, "scale", "4") == 0
    assert capsys.readouterr().out == "desired replicas: 4\n"
    assert api.fleet.desired_total == 4
