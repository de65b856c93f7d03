"""A drill's run request: its aim (replicas, zones) checked against the fleet and resolved, its load (a
Poisson rate or an Azure trace replay) checked and turned into the load client's command line, and every
bad request refused with a 400 in the OpenAI error shape naming the field, audited.

The fleet is a fake here (``FakePort``: three replicas in three zones with chosen streams in flight): these
tests are about the request and the plan, which change nothing, and a real fleet takes a minute to start.
The live run of an aimed drill under trace load is in ``tests/controlplane/up/test_drills.py``. Everything
else is real: the control plane's API app with its auth and audit, the drill service and runner, the fault
manager and its catalogue, the shipped scenarios, and the load client's own argument parser and planner.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from chaos.catalogue import default_catalogue
from chaos.drill_trace import resolve_trace
from chaos.drills import DrillRunner, FleetSample, Timings, load_command
from chaos.safety import FaultManager
from chaos.scenarios import AZURE_TRACE_ENV, scenario
from chaos.targets import Target
from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.drills.service import COLLECTION, DrillService
from controlplane.fleet.backends.local import LocalProcessBackend
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.reconcile import Fleet
from controlplane.store.database import Store
from inference.bench.datasets import shipped_trace
from inference.bench.load_config import plan_requests
from inference.bench.serve import add_arguments, config_from_args
from tests.chaos.fakes import FakeTarget

Api = tuple[TestClient, dict[str, str]]
REPLICAS = [FakeTarget("zone-a-0", zone="zone-a"), FakeTarget("zone-b-0", zone="zone-b"),
            FakeTarget("zone-b-1", zone="zone-b"), FakeTarget("zone-c-0", zone="zone-c")]


class FakePort:
    """The control plane as a drill sees it, without processes: REPLICAS, with ``inflight`` streams."""

    gateway_url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.streams: dict[str, int] = {}

    def fleet_sample(self) -> FleetSample:
        return FleetSample(0.0, len(REPLICAS), len(REPLICAS), False)

    def inflight(self) -> Mapping[str, int]:
        return self.streams

    def targets(self) -> Sequence[Target]:
        return REPLICAS

    def timings(self) -> Timings:
        return Timings(replica_start_s=8.0, health_interval_s=1.0, reconcile_interval_s=1.0,
                       stall_timeout_s=2.0, first_byte_timeout_s=2.0, restart_backoff_s=1.0,
                       rollout_observe_s=2.0, replicas=len(REPLICAS))

    def start_rollout(self) -> str:
        raise AssertionError("a request test never rolls out")

    def resumes_between(self, start_wall: float, end_wall: float) -> int:
        return 0

    def write_marks(self, drill_id: str, n: int) -> list[int]:
        return []

    def count_marks(self, ids: Sequence[int]) -> int:
        return 0


@pytest.fixture
def port() -> FakePort:
    return FakePort()


@pytest.fixture
def api(tmp_path: Path, store: Store, port: FakePort) -> Iterator[tuple[TestClient, dict[str, str]]]:
    tokens = TokenAuthority(store)
    backend = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
    fleet = Fleet(FleetConfig(replicas=0), backend, store, secret=b"k" * 32)  # never started: no process
    drills = DrillService(DrillRunner(port, FaultManager(default_catalogue(), store)), store, tmp_path)
    app = create_api(Services(fleet, store, tokens, Auditor(store), drills=drills))
    secrets = {role.value: tokens.issue(f"{role.value}-1", role) for role in Role}
    with TestClient(app) as client:
        yield client, secrets


def _trace(path: Path, offsets: Sequence[float], context: int = 300, generated: int = 40) -> Path:
    """An Azure LLM trace CSV with requests at ``offsets`` seconds; token counts grow by one per row."""
    t0 = datetime(2023, 11, 16, 18, 15, 46)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for i, offset in enumerate(offsets):
            out.writerow([(t0 + timedelta(seconds=offset)).strftime("%Y-%m-%d %H:%M:%S.%f0"), context + i,
                          generated + i])
    return path


def _run(api: Api, body: dict[str, Any], role: str = "operator") -> Any:
    client, secrets = api
    return client.post("/api/v1/drills/run", json=body, headers={"Authorization": f"Bearer {secrets[role]}"})


def _refused(api: Api, body: dict[str, Any], param: str, *words: str) -> str:
    resp = _run(api, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(f"{param}: ")
    for word in words:
        assert word in error["message"], error["message"]
    return str(error["message"])


# ---- aim ---------------------------------------------------------------------------------------
def test_an_unknown_replica_or_zone_is_refused_before_anything_starts_and_audited(
        api: Api, store: Store) -> None:
    message = _refused(api, {"scenario": "replica-crash", "replicas": ["zone-z-9"]}, "replicas", "'zone-z-9'",
                       "zone-a-0, zone-b-0")
    _refused(api, {"scenario": "zone-outage", "zones": ["zone-q"], "dry_run": True}, "zones", "'zone-q'",
             "zone-a, zone-b, zone-c")
    _refused(api, {"scenario": "replica-crash", "replicas": ["zone-a-0"], "zones": ["zone-b"]}, "zones",
             "zone-a-0 is in zone zone-a")
    assert store.records(COLLECTION) == []  # no drill was started
    runs = store.audit(action_prefix="drill.run")
    assert len(runs) == 3 and {r.outcome for r in runs} == {"error"}
    assert runs[-1].detail == message and runs[-1].params["replicas"] == ["zone-z-9"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"scenario": "zone-outage", "zones": ["zone-a", "zone-b"]}, "zones", ("takes one zone", "got 2")),
    ({"scenario": "zone-outage", "replicas": ["zone-a-0"]}, "replicas", ("takes one zone",)),
    ({"scenario": "replica-crash", "replicas": ["zone-a-0", "zone-b-0"]}, "replicas", ("takes one replica",)),
    ({"scenario": "rolling-update", "zones": ["zone-a"]}, "zones", ("takes no target",)),
    ({"scenario": "replica-crash", "replicas": [""]}, "replicas", ("list of names",)),
])
def test_an_aim_the_scenario_cannot_take_is_refused(api: Api, body: dict[str, Any], param: str,
                                                    words: tuple[str, ...]) -> None:
    _refused(api, body, param, *words)


def test_the_dry_run_shows_the_named_replica_as_the_fault_target(api: Api,
                                                                  port: FakePort) -> None:
    port.streams = {"zone-b-1": 5}  # the default would be the busiest replica
    plan = _run(api, {"scenario": "replica-crash", "replicas": ["zone-c-0"], "dry_run": True}).json()["plan"]
    assert plan["targets_requested"] == {"replicas": ["zone-c-0"], "zones": []}
    assert plan["targets_resolved"]["replicas"] == ["zone-c-0"]
    assert "named" in plan["targets_resolved"]["how"]
    assert [f["targets"] for f in plan["faults"]] == [["zone-c-0"]]


def test_a_zone_aims_a_single_replica_fault_at_its_busiest_replica(api: Api,
                                                                     port: FakePort) -> None:
    port.streams = {"zone-a-0": 9, "zone-b-0": 1, "zone-b-1": 3}
    plan = _run(api, {"scenario": "replica-crash", "zones": ["zone-b"], "dry_run": True}).json()["plan"]
    assert plan["targets_resolved"]["replicas"] == ["zone-b-1"]
    assert plan["faults"][0]["targets"] == ["zone-b-1"]
    default = _run(api, {"scenario": "replica-crash", "dry_run": True}).json()["plan"]
    assert default["targets_requested"] == {"replicas": [], "zones": []}
    assert default["faults"][0]["targets"] == ["zone-a-0"]  # unchanged default: the busiest of the fleet


def test_a_zone_outage_takes_the_named_zone_whole(api: Api, port: FakePort) -> None:
    port.streams = {"zone-a-0": 4}  # the default would take zone-a
    plan = _run(api, {"scenario": "zone-outage", "zones": ["zone-b"], "dry_run": True}).json()["plan"]
    assert plan["targets_resolved"] == {"replicas": ["zone-b-0", "zone-b-1"], "zones": ["zone-b"],
                                        "how": "zone zone-b (named)"}
    assert plan["faults"][0]["targets"] == ["zone-b-0", "zone-b-1"]
    default = _run(api, {"scenario": "zone-outage", "dry_run": True}).json()["plan"]
    assert default["faults"][0]["targets"] == ["zone-a-0"]


# ---- load --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("load", "param", "word"), [
    ({"kind": "burst", "rate": 3}, "load.kind", "'rate' or 'trace'"),
    ({"rate": 3}, "load.kind", "required"),
    ({"kind": "rate", "rate": 3, "compress": 2}, "load.compress", "unknown for a rate load"),
    ({"kind": "trace", "compress": 2}, "load.trace", "'azure' or the path"),
    ({"kind": "trace", "trace": "azure", "compress": 0}, "load.compress", "greater than 0"),
])
def test_a_bad_load_is_refused_naming_the_field(api: Api, load: dict[str, Any],
                                                param: str, word: str) -> None:
    _refused(api, {"scenario": "replica-crash", "load": load}, param, word)


def test_a_missing_trace_is_refused_with_where_it_was_looked_for(api: Api,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nowhere" / "trace.csv"
    _refused(api, {"scenario": "replica-crash", "load": {"kind": "trace", "trace": str(missing)}},
             "load.trace", f"no trace file at {missing}")
    monkeypatch.setenv(AZURE_TRACE_ENV, str(missing))
    _refused(api, {"scenario": "replica-crash", "load": {"kind": "trace", "trace": "azure"}, "dry_run": True},
             "load.trace", str(missing), f"${AZURE_TRACE_ENV}")
    not_a_trace = tmp_path / "other.csv"
    not_a_trace.write_text("a,b\n1,2\n")
    _refused(api, {"scenario": "replica-crash", "load": {"kind": "trace", "trace": str(not_a_trace)}},
             "load.trace", "missing columns")


def test_a_trace_window_without_requests_or_with_a_rate_is_refused(api: Api,
                                                                    tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.csv", [0.0, 1.0, 2.0])
    _refused(api, {"scenario": "replica-crash", "load": {"kind": "trace", "trace": str(trace),
                                                         "trace_start_s": 60}}, "load.trace_start_s",
             "no request in the window [60, 74)")
    _refused(api, {"scenario": "replica-crash", "rate": 2, "load": {"kind": "trace", "trace": str(trace)}},
             "rate", "arrivals from the trace")
    _refused(api, {"scenario": "replica-crash", "rate": 2, "load": {"kind": "rate", "rate": 3}}, "rate",
             "disagrees")


def test_the_bare_rate_and_a_rate_load_both_set_the_poisson_rate(api: Api) -> None:
    bare = _run(api, {"scenario": "replica-crash", "rate": 2.5, "dry_run": True}).json()["plan"]
    assert bare["load"] == {"kind": "rate", "rate": 2.5, "duration_s": scenario("replica-crash").duration_s}
    profile = _run(api, {"scenario": "replica-crash", "load": {"kind": "rate", "rate": 3}, "dry_run": True})
    assert profile.json()["plan"]["load"]["rate"] == 3
    assert profile.json()["plan"]["scenario"]["rate"] == 3


def test_a_trace_load_plans_the_window_and_the_load_client_replays_exactly_it(
        api: Api, tmp_path: Path) -> None:
    offsets = [0.5 * i for i in range(40)]  # two requests a second of trace for 20 s
    trace = _trace(tmp_path / "trace.csv", offsets)
    load = {"kind": "trace", "trace": str(trace), "compress": 2, "token_scale": 0.1, "trace_start_s": 3}
    resp = _run(api, {"scenario": "replica-crash", "duration_s": 5, "fault_at_s": 2, "max_tokens": 5,
                      "load": load, "dry_run": True})
    assert resp.status_code == 200, resp.text
    plan = resp.json()["plan"]
    window = [o for o in offsets if 3 <= o < 3 + 5 * 2]  # 10 s of trace in the 5 s of load
    assert plan["load"]["kind"] == "trace" and plan["load"]["path"] == str(trace.resolve())
    assert plan["load"]["requests"] == len(window) == 20
    assert plan["load"]["mean_rate"] == plan["scenario"]["rate"] == 4.0  # used by the RTO prediction

    sc = scenario("replica-crash").with_overrides({"duration_s": 5, "fault_at_s": 2, "max_tokens": 5,
                                                   "load": load})
    cmd = load_command(sc, "http://127.0.0.1:8000", tmp_path)
    assert cmd[1:4] == ["-m", "inference.bench", "serve"] and "--request-rate" not in cmd
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(cmd[4:]))
    requests = plan_requests(cfg)
    assert len(requests) == 20 and cfg.duration == 5
    assert [r.arrival for r in requests] == pytest.approx([(o - 3) / 2 for o in window])
    first = offsets.index(window[0])
    assert [r.prompt_len for r in requests] == [round((300 + first + i) * 0.1) for i in range(20)]
    assert all(r.output_len == 4 or r.output_len == 5 for r in requests)  # 4.x tokens, capped at max_tokens


def test_azure_means_the_environment_variable_else_the_trace_shipped_with_the_package(tmp_path: Path) -> None:
    work = tmp_path / "main"
    work.mkdir()
    assert resolve_trace("azure", cwd=work, environ={}) == shipped_trace().resolve()
    assert resolve_trace("azure", cwd=work, environ={AZURE_TRACE_ENV: " "}) == shipped_trace().resolve()
    elsewhere = _trace(tmp_path / "mine.csv", [0.0])
    assert resolve_trace("azure", cwd=work, environ={AZURE_TRACE_ENV: str(elsewhere)}) == elsewhere.resolve()
    assert resolve_trace("../mine.csv", cwd=work, environ={}) == elsewhere.resolve()


def test_a_drill_under_the_azure_trace_plans_the_shipped_trace_with_nothing_set(
        api: Api, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(AZURE_TRACE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # found from the package, not from the working directory
    resp = _run(api, {"scenario": "replica-crash", "duration_s": 10, "fault_at_s": 3,
                      "load": {"kind": "trace", "trace": "azure", "compress": 2}, "dry_run": True})
    assert resp.status_code == 200, resp.text
    load = resp.json()["plan"]["load"]
    assert load["trace"] == "azure" and load["path"] == str(shipped_trace().resolve())
    assert load["requests"] == 31  # the first 20 s of the trace, replayed in 10 s


def test_a_viewer_may_not_run_even_a_dry_run(api: Api) -> None:
    resp = _run(api, {"scenario": "replica-crash", "replicas": ["zone-a-0"], "dry_run": True}, role="viewer")
    assert resp.status_code == 403
