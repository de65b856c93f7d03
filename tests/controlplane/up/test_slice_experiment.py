"""A slice experiment on a real ``controlplane up`` (two replicas of the default model; autoscaler, alerts and
console off), under load from several concurrent clients through the gateway.

The experiment is started with the CLI (``controlplane experiment slice --wait``): a 10% colour with an
``error_rate`` fault of probability 1 on it, against a 10% control colour. The clients name each request's
conversation (``x-session-id``), so the test knows each request's colour by the gateway's own assignment and
checks on the client side that no uncoloured request failed; the report must show both sides with the
interval of the difference, the run must have stopped itself on the deviation long before its duration, the
fault must be reverted and the colours cleared (requests of the experiment colour succeed again). Then the
drill library's ``slice-error-rate`` scenario runs the same experiment under the drill's load client and
passes at its own targets.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from chaos.drill_bench import quiet_base_port
from chaos.scenarios import SCENARIOS, TARGET_FIGURES
from controlplane.cli.main import main as cli
from controlplane.gateway.slices import Share, SlicePlan, assign
from inference.launcher import free_port

from .conftest import Running, shutdown, start, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a backstop: each wait below has its own bound

TOKEN = "admin-token-for-slice-experiments"
CLIENTS = 6
SHARE = 0.1
DURATION_S = 60.0  # the run's longest; it must stop itself on the deviation long before
# The gateway's assignment, as the control plane colours the traffic: {"chaos": 0.1, "control": 0.1}.
PLAN = SlicePlan(colours=(Share("chaos", SHARE), Share("control", SHARE)))


def colour_of(session: str) -> str | None:
    return assign(PLAN, f"session:{session}").colour


def write_slice_config(tmp: Path) -> Path:
    config = tmp / "slices.toml"
    config.write_text(f"""
state_dir = "{tmp / 'state'}"
[api]
port = {free_port()}
[gateway]
port = {free_port()}
[fleet]
replicas = 2
base_port = {quiet_base_port(8)}
[prometheus]
port = {free_port()}
scrape_interval_s = 1.0
[autoscaler]
enabled = false
[alerts]
enabled = false
[console]
enabled = false
""")
    return config


@pytest.fixture(scope="module")
def cp(model_state: Path) -> Iterator[Running]:
    running = start(write_slice_config(model_state), model_state, TOKEN)
    try:
        wait_ready(running, 2)
        yield running
    finally:
        shutdown(running)


@dataclass
class Load:
    """Closed-loop clients, each request its own conversation (so its colour is known here)."""

    gateway: str
    model: str
    # session, its colour, whether it succeeded, when it ended
    results: list[tuple[str, str | None, bool, float]] = field(default_factory=list)
    why: Counter[str] = field(default_factory=Counter)  # the failed requests' reasons, by colour
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, clients: int) -> None:
        for c in range(clients):
            thread = threading.Thread(target=self._client, args=(c,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _client(self, c: int) -> None:
        with httpx.Client(base_url=self.gateway, timeout=30.0, trust_env=False) as http:
            i = 0
            while not self.stop.is_set():
                session = f"c{c}-r{i}"
                i += 1
                failure = failure_of(http, self.model, session)
                self.results.append((session, colour_of(session), failure is None, time.time()))
                if failure is not None:
                    self.why[f"{colour_of(session) or 'uncoloured'}: {failure}"] += 1

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def failure_of(http: httpx.Client, model: str, session: str) -> str | None:
    """One streamed completion; None when the whole answer came, else what went wrong (status and code)."""
    body = {"model": model, "prompt": f"slice experiment {session}", "max_tokens": 4, "temperature": 0.0,
            "stream": True}
    try:
        with http.stream("POST", "/v1/completions", json=body, headers={"x-session-id": session}) as resp:
            if resp.status_code != 200:
                resp.read()
                is_json = resp.headers.get("content-type", "").startswith("application/json")
                error = (resp.json().get("error") or {}) if is_json else {}
                return f"{resp.status_code} {error.get('code') or error.get('type') or ''}".strip()
            lines = [line for line in resp.iter_lines() if line.startswith("data:")]
    except httpx.HTTPError as exc:
        return type(exc).__name__
    if any('"error"' in x for x in lines):
        return "error frame"
    return None if lines and lines[-1].strip() == "data: [DONE]" else "no [DONE]"


def send(http: httpx.Client, model: str, session: str) -> bool:
    """One streamed completion; whether the whole answer came."""
    return failure_of(http, model, session) is None


def model_of(gateway: str) -> str:
    return str(httpx.get(f"{gateway}/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"])


def test_a_coloured_error_rate_stops_itself_and_never_reaches_the_uncoloured(
        cp: Running, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    load = Load(cp.gateway, model_of(cp.gateway))
    load.start(CLIENTS)
    monkeypatch.setenv("CONTROLPLANE_TOKEN", TOKEN)
    try:
        time.sleep(1.0)  # the load is flowing before the colours go on
        started = time.monotonic()
        code = cli(["--url", cp.api, "experiment", "slice", "--share", str(SHARE), "--fault", "error_rate",
                    "--set", "probability=1.0", "--duration", str(DURATION_S), "--check-interval", "0.5",
                    "--wait", "--json"])
        took = time.monotonic() - started
    finally:
        load.finish()
    out = capsys.readouterr().out
    assert code == 0, out
    shown = json.loads(out)
    with cp.client() as client:
        result = client.slice_experiment(shown["id"])
        faults = client.chaos_faults()
        listed = client.slice_experiments()
    report, stopped = result.report, result.stopped
    assert report is not None and stopped is not None
    error = report.difference("error_rate")
    assert error is not None
    coloured = [r for r in load.results if r[1] == "chaos"]
    uncoloured = [r for r in load.results if r[1] is None]
    print(f"\nslice experiment {result.id}: {result.status} after {stopped.after_s} s ({took:.1f} s with the "
          f"CLI): experiment {report.experiment.failed}/{report.experiment.requests} failed, control "
          f"{report.control.failed}/{report.control.requests}, uncoloured {report.uncoloured.failed}/"
          f"{report.uncoloured.requests}; error-rate difference {error.estimate:+.3f} "
          f"[{error.low:+.3f}, {error.high:+.3f}] ({error.method}); client side: "
          f"{sum(not r[2] for r in coloured)}/{len(coloured)} experiment-colour requests failed, "
          f"{sum(not r[2] for r in uncoloured)}/{len(uncoloured)} uncoloured")
    # It stopped itself, on the deviation, long before its duration.
    assert result.status == "deviated" and stopped.reason == "deviation", result.document
    assert stopped.after_s is not None and stopped.after_s < DURATION_S / 2
    # The uncoloured requests saw no injected error: by the report and by the clients themselves.
    assert report.uncoloured.failed == 0 and report.uncoloured.requests > 0, dict(load.why)
    assert uncoloured and not [r for r in uncoloured if not r[2]], dict(load.why)
    assert report.control.failed == 0
    # Both sides are reported, and the difference with its interval.
    assert report.experiment.requests >= result.spec.bounds.min_samples
    assert report.control.requests >= result.spec.bounds.min_samples
    assert report.experiment.failed >= result.spec.bounds.min_samples
    assert report.experiment.metrics["errors"].error_rate > 0.5
    assert error.confidence == 0.95 and 0 < error.low <= error.estimate <= error.high
    assert report.analysis["verdict"] == "fail"
    assert [c.verdict for c in result.checks][-1] == "fail"
    # The fault is reverted and the colours cleared: the experiment colour's requests succeed again.
    assert result.faults_reverted and result.colours_cleared and len(result.fault_ids) == 2
    assert faults == []
    assert listed[0].id == result.id and listed[0].status == "deviated"
    time.sleep(1.0)  # the cleared plan reaches the gateway within the feed's long poll
    with httpx.Client(base_url=cp.gateway, timeout=30.0, trust_env=False) as http:
        sessions = [s for s in (f"after-{i}" for i in range(400)) if colour_of(s) == "chaos"][:8]
        assert all(send(http, load.model, s) for s in sessions)


def test_the_slice_error_rate_drill_passes_at_its_targets(cp: Running) -> None:
    sc = SCENARIOS["slice-error-rate"]
    with cp.client() as client:
        started = client.drill_run(sc.id, duration_s=16.0)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            report = client.drill(started.id)
            if report.status not in ("running",):
                break
            time.sleep(1.0)
        document: dict[str, Any] = dict(report.document)
    fig, record = document.get("figures") or {}, document.get("slice_experiment") or {}
    print(f"\n{sc.id}: {document['status']}; uncoloured failed {fig.get('uncoloured_failed')}, self-stop "
          f"after {fig.get('slice_stop_s')} s, sides missing {fig.get('slice_sides_missing')}; client: "
          f"{fig.get('requests_failed')}/{fig.get('requests_total')} failed; checks "
          f"{[(c['name'], c['measured'], c['outcome']) for c in document.get('checks', [])]}")
    assert document["status"] == "passed", document.get("error") or document.get("checks")
    for name, figure in TARGET_FIGURES.items():
        target = getattr(sc.targets, name)
        if target is not None:
            assert fig[figure] is not None and fig[figure] <= target, (figure, fig[figure], target)
    assert record["status"] == "deviated" and record["faults_reverted"] and record["colours_cleared"]
    assert record["report"]["experiment"]["failed"] > 0 and record["report"]["control"]["failed"] == 0
