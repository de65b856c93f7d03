"""``/api/v1/experiments/slices`` in this process, through the typed client and the CLI: a run started by an
operator stops itself on the deviation and its report decodes into the client's records; a second start
while it runs is a 409, a bad body a 400 naming the field, an unknown id a 404, a viewer may read but not
start; start and abort are audited. The fault kind records (a recording ``error_rate``) and the gateways'
outcomes are scripted (``tests/controlplane/rollouts/test_experiment.py``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from chaos.catalogue import Catalogue
from chaos.safety import FaultManager
from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.cli.main import main as cli
from controlplane.client import ApiError, ControlPlaneClient, SliceExperiment
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.reconcile import Fleet
from controlplane.replicas import ReplicaEndpoint
from controlplane.rollouts.experiment import SliceExperiments
from controlplane.rollouts.traffic import TrafficSlices
from controlplane.store.database import Store
from tests.chaos.fakes import fleet as targets
from tests.controlplane.fleet.test_reconcile import SimBackend
from tests.controlplane.rollouts.test_experiment import ColouredFault, Gateway
from tests.in_process import InProcess

URL = "http://controlplane.test"


@dataclass
class Api:
    transport: InProcess
    tokens: dict[str, str]
    store: Store
    fault: ColouredFault

    def client(self, role: str = "operator") -> ControlPlaneClient:
        return ControlPlaneClient(URL, self.tokens[role], transport=self.transport)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    async def is_ready(_: ReplicaEndpoint) -> bool:
        return True

    with Store(tmp_path / "state.db") as store:
        fleet = Fleet(FleetConfig(replicas=2, zones=["az-a", "az-b"]), SimBackend(), store, secret=b"s" * 32,
                      ready_probe=is_ready)
        fault = ColouredFault(name="error_rate")
        manager = FaultManager(Catalogue([fault]), store)
        experiments = SliceExperiments(TrafficSlices(store, Gateway(experiment_fails=True)), manager,
                                       lambda: targets(2), store)
        tokens, auditor = TokenAuthority(store), Auditor(store)
        services = Services(fleet, store, tokens, auditor, chaos=manager, experiments=experiments)
        with TestClient(create_api(services), base_url=URL) as client:
            yield Api(InProcess(client), {r.value: tokens.issue(f"{r.value}-1", r) for r in Role}, store,
                      fault)


def wait_finished(client: ControlPlaneClient, experiment_id: int) -> SliceExperiment:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = client.slice_experiment(experiment_id)
        if result.finished:
            return result
        time.sleep(0.05)
    raise AssertionError(f"slice experiment {experiment_id} still running")


def test_a_run_through_the_api_stops_itself_and_reports_both_sides(api: Api) -> None:
    with api.client() as client:
        started = client.slice_experiment_start(share=0.1, fault="error_rate", params={"probability": 1.0},
                                                duration_s=20, check_interval_s=0.1,
                                                bounds={"min_samples": 5})
        assert started.status == "running"
        with pytest.raises(ApiError) as busy:
            client.slice_experiment_start(share=0.1, fault="error_rate", params={"probability": 1.0})
        assert busy.value.status == 409
        result = wait_finished(client, started.id)
        listed = client.slice_experiments()
        audit = [a.action for a in client.audit()]
    assert result.status == "deviated" and result.stopped is not None
    assert result.stopped.reason == "deviation" and result.faults_reverted and result.colours_cleared
    report = result.report
    assert report is not None
    assert report.experiment.failed == report.experiment.requests >= 5 and report.control.failed == 0
    assert report.uncoloured.failed == 0 and report.experiment.metrics["errors"].error_rate == 1.0
    error = report.difference("error_rate")
    assert error is not None and error.low > 0 and error.confidence == 0.95
    assert result.spec.params == {"probability": 1.0} and result.spec.bounds.min_samples == 5
    assert [r.id for r in listed] == [started.id] and listed[0].experiment is not None
    assert audit.count("experiment.slice.start") == 2  # the refused one too
    assert len(api.fault.reverted) == 2


@pytest.mark.parametrize(("body", "param"), [
    ({"share": 0.6, "fault": "error_rate"}, "share"),
    ({"share": 0.1, "fault": "kill"}, "fault"),
    ({"share": 0.1, "fault": "error_rate", "params": {"colour": "other"}}, "params.colour"),
    ({"share": 0.1, "fault": "error_rate", "control": "chaos"}, "control"),
    ({"share": 0.1, "fault": "error_rate", "bounds": {"alpha": 0.9}}, "bounds.alpha"),
    ({"share": 0.1, "fault": "error_rate", "params": {"seconds": 1.0}}, "params.seconds"),
])
def test_a_body_the_run_cannot_take_is_a_400_naming_the_field(api: Api, body: dict[str, object],
                                                              param: str) -> None:
    with TestClient(api.transport.client.app, base_url=URL) as http:
        answer = http.post("/api/v1/experiments/slices", json=body,
                           headers={"authorization": f"Bearer {api.tokens['operator']}"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_ids_roles_and_abort(api: Api) -> None:
    with api.client("viewer") as viewer:
        assert viewer.slice_experiments() == []
        with pytest.raises(ApiError) as missing:
            viewer.slice_experiment(7)
        assert missing.value.status == 404
        with pytest.raises(ApiError) as forbidden:
            viewer.slice_experiment_start(share=0.1, fault="error_rate", params={"probability": 1.0})
        assert forbidden.value.status == 403
    with api.client() as client:
        with pytest.raises(ApiError) as not_running:
            client.slice_experiment_abort(7)
        assert not_running.value.status == 404
        started = client.slice_experiment_start(share=0.1, fault="error_rate", params={"probability": 1.0},
                                                duration_s=60, check_interval_s=0.2,
                                                bounds={"min_samples": 100_000})  # never decides
        time.sleep(0.3)
        assert client.slice_experiment_abort(started.id).aborting
        result = wait_finished(client, started.id)
        with pytest.raises(ApiError) as again:
            client.slice_experiment_abort(started.id)
        assert again.value.status == 409
    assert result.status == "aborted" and result.faults_reverted and result.colours_cleared


def test_the_cli_starts_follows_and_shows_a_run(api: Api, capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    token = tmp_path / "operator.token"
    token.write_text(api.tokens["operator"])
    token.chmod(0o600)
    base = ["--url", URL, f"--token-file={token}", "experiment"]
    code = cli([*base, "slice", "--share", "0.1", "--fault", "error_rate", "--set", "probability=1",
                "--duration", "20", "--check-interval", "0.1", "--min-samples", "5", "--wait", "--json"],
               transport=api.transport)
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and shown["status"] == "deviated" and shown["report"]["uncoloured"]["failed"] == 0
    assert cli([*base, "show", str(shown["id"])], transport=api.transport) == 0
    text = capsys.readouterr().out
    assert "stopped: deviation" in text and "difference error_rate: +1.0000" in text
    assert cli([*base, "list"], transport=api.transport) == 0
    assert "deviated" in capsys.readouterr().out
    assert cli([*base, "slice", "--share", "0.1", "--fault", "error_rate", "--set", "probability"],
               transport=api.transport) == 2
    assert "--set: expected NAME=VALUE" in capsys.readouterr().err
    assert cli([*base, "slice", "--share", "0.9", "--fault", "error_rate"], transport=api.transport) == 1
    assert "share" in capsys.readouterr().err

