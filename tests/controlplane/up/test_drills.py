"""Every shipped drill scenario against a real fleet under load, through a real ``controlplane up``.

One control plane (two replicas, the default model; autoscaler, alerts and console off so that nothing else
moves the fleet) serves the whole module. Each drill runs the real load client as a separate process
against the gateway; the test reads that client's JSONL itself and checks the report's figures against it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from chaos.drill_bench import quiet_base_port
from chaos.drills import LOAD_GRACE_S, LOAD_START_TIMEOUT_S, STREAM_WAIT_S
from chaos.scenarios import SCENARIOS, TARGET_FIGURES
from controlplane.client import ApiError, ControlPlaneClient
from controlplane.drills.report import timeline_figure
from inference.bench.datasets import read_trace, shipped_trace
from inference.bench.report import read_jsonl
from inference.launcher import free_port

from .conftest import Running, poll, processes, shutdown, start, wait_ready

# the timeout is a backstop: each wait below has its own bound
pytestmark = [pytest.mark.exclusive, pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "admin-token-for-drill-tests"
FINISHED = ("passed", "failed", "aborted", "error", "interrupted")
LOAD: dict[str, Any] = {"rate": 4.0, "duration_s": 10.0, "fault_at_s": 3.0, "max_tokens": 16}
# The kills that must catch streams in flight use longer ones: a 16-token stream lasts a few hundred ms,
# and between the drill's aim and its kill the one it aimed at could end (the drill then measures an idle
# kill; a clean-clone run of the suite saw it once). 64 tokens held until replicas decoded a token in
# about 2 ms (the kernel's own linears, 2026-12-06: a 64-token stream then lasted about 150 ms, and a
# zone-outage run hit none); 256 last half a second or more.
LONG_STREAMS: dict[str, Any] = {"max_tokens": 256}
AZURE = shipped_trace()  # the Azure LLM conversation trace (2023): what "azure" names


def write_drill_config(tmp: Path) -> Path:
    config = tmp / "drills.toml"
    config.write_text(f"""
state_dir = "{tmp / 'state'}"
[api]
port = {free_port()}
[gateway]
port = {free_port()}
[fleet]
replicas = 2
base_port = {quiet_base_port(8)}
rollout_observe_s = 2.0
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
    running = start(write_drill_config(model_state), model_state, TOKEN)
    try:
        wait_ready(running, 2)
        yield running
    finally:
        shutdown(running)


def drill_bound_s(scenario: str, **overrides: Any) -> float:
    """The longest a drill of ``scenario`` may run by its own deadlines (steady state, load start, load,
    the wait for a stream, observation, the load's grace), plus a minute for the report."""
    sc = SCENARIOS[scenario].with_overrides({k: v for k, v in overrides.items() if k != "load"})
    return (sc.steady_state_timeout_s + LOAD_START_TIMEOUT_S + sc.duration_s + STREAM_WAIT_S
            + sc.capacity_deadline_s + LOAD_GRACE_S + 60.0)


def wait_finished(client: ControlPlaneClient, drill_id: int, *, timeout: float) -> dict[str, Any]:
    """The finished drill's whole report, as stored."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = client.drill(drill_id)
        if report.status in FINISHED:
            return dict(report.document)
        time.sleep(1.0)
    raise AssertionError(f"drill {drill_id} still {report.status} after {timeout:g}s: {report.progress}")


def run_drill(cp: Running, scenario: str, **overrides: Any) -> dict[str, Any]:
    with cp.client() as client:
        wait_ready(cp, 2)
        started = client.drill_run(scenario, **{**LOAD, **overrides})
        report = wait_finished(client, started.id, timeout=drill_bound_s(scenario, **{**LOAD, **overrides}))
    fig = report.get("figures") or {}
    pred = report.get("prediction") or {}
    print(f"\n{scenario}: status {report['status']}, RTO_service {fig.get('rto_service_s')} s "
          f"(predicted {pred.get('rto_service_s')}), RTO_slo {fig.get('rto_slo_s')} s, "
          f"RTO_capacity {fig.get('rto_capacity_s')} s (predicted {pred.get('rto_capacity_s')}), "
          f"failed {fig.get('requests_failed')}, "
          f"resumed {fig.get('requests_resumed')}, tokens lost {fig.get('tokens_lost')}")
    assert report["status"] in ("passed", "failed"), report.get("error") or report
    check_against_client_timeline(report)
    print_slowest_recovery(report)
    return report


def assert_meets_targets(report: dict[str, Any]) -> None:
    """The drill passed at its scenario's own targets, as ``chaos/scenarios.py`` defines them (the tests
    override none): every judged figure was measured and is within its target."""
    sc = SCENARIOS[report["scenario"]]
    assert report["config"]["targets"] == dataclasses.asdict(sc.targets)
    fig = report["figures"]
    for name, figure in TARGET_FIGURES.items():
        target = getattr(sc.targets, name)
        if target is not None:
            assert fig[figure] is not None, f"{figure}: not measured ({report['checks']})"
            assert fig[figure] <= target, f"{figure} {fig[figure]} over its target {target}"
    assert [c["outcome"] for c in report["checks"]] == ["pass"] * len(report["checks"]), report["checks"]
    assert report["status"] == "passed"


def assert_every_affected_stream_recovered(report: dict[str, Any]) -> None:
    """The fault hit streams in flight, and each of them flowed again (none ended in an error)."""
    fig = report["figures"]
    assert fig["requests_affected"] > 0, "the fault hit no stream: the drill measured an idle kill"
    assert len(fig["outages_s"]) == fig["requests_affected"], fig


def print_slowest_recovery(report: dict[str, Any]) -> None:
    """The request whose recovery set RTO_service, as the client saw it (shown when an RTO check fails)."""
    fig, t0 = report["figures"], report["t0"]
    if fig["t_service"] is None:
        return
    for r in read_jsonl(Path(report["load"]["jsonl"])):
        walls = [r.send_wall + t - r.send_time - t0 for t in r.token_times]
        if walls and min(abs(w - fig["t_service"]) for w in walls) < 1e-3:
            print(f"  slowest recovery: {r.request_id} sent {r.send_wall - t0:+.3f} s, first token "
                  f"{walls[0]:+.3f} s, last {walls[-1]:+.3f} s, {len(walls)} tokens, served by "
                  f"{r.replica_id}, tried {list(r.tried)}")


def check_against_client_timeline(report: dict[str, Any]) -> None:
    """The report's figures agree with the load client's own JSONL, read here independently."""
    records = read_jsonl(Path(report["load"]["jsonl"]))
    fig = report["figures"]
    t0 = report["t0"]
    assert fig["requests_total"] == len(records) > 0
    assert fig["requests_failed"] == sum(1 for r in records if not r.is_success)
    owed = [(r.output_len, r.completion_tokens) for r in records if r.is_success]
    assert fig["tokens_lost"] == sum(max(o - (g or 0), 0) for o, g in owed)
    assert fig["tokens_duplicated"] == sum(max((g or 0) - o, 0) for o, g in owed)
    walls = [r.send_wall + t - r.send_time for r in records for t in r.token_times]
    for name in ("t_first_ok", "t_service", "t_switch"):
        if fig[name] is not None:  # each is a token the client really received (times kept to 0.1 ms)
            assert min(abs(w - (t0 + fig[name])) for w in walls) < 1e-3, name
    if fig["t_service"] is not None:
        assert fig["rto_service_s"] == pytest.approx(fig["t_service"], abs=1e-3)
    assert fig["writes_lost"] == 0
    first_send = min(r.send_wall for r in records)
    assert first_send < t0  # the fault hit a running load, not an idle fleet


def gateway_saw_stall(cp: Running, report: dict[str, Any]) -> bool:
    """The gateway recorded the drill's target as stalled while the fault was on."""
    with cp.client() as client:
        events = client.events(kind="gateway.stalled", limit=1000)
    target = report["fault_targets"][0]
    return any(e.subject == target and e.ts >= report["t0"] for e in events)


def test_replica_crash_loses_no_request_and_serves_again_within_its_target(cp: Running) -> None:
    report = run_drill(cp, "replica-crash", **LONG_STREAMS)
    assert_meets_targets(report)
    assert_every_affected_stream_recovered(report)
    fig = report["figures"]
    # Resumes are counted here, not required: a request the crash caught may have been moved before its
    # first token, or read to its end by the gateway already. Resuming mid-stream is asserted where a
    # replica is killed while it is still generating (tests/controlplane/up/test_failover.py,
    # tests/controlplane/gateway/test_failover.py).
    assert fig["requests_resumed"] is not None
    assert fig["rto_capacity_s"] > 0  # the replica really went, and came back
    assert report["prediction"]["rto_capacity_s"] is not None


def test_zone_outage_kills_one_zone_and_loses_nothing(cp: Running) -> None:
    report = run_drill(cp, "zone-outage", **LONG_STREAMS)
    zones = {t.rsplit("-", 1)[0] for t in report["fault_targets"]}
    assert len(zones) == 1
    assert_meets_targets(report)
    assert_every_affected_stream_recovered(report)
    assert report["figures"]["requests_resumed"] is not None


def test_device_failure_loses_no_request(cp: Running) -> None:
    assert_meets_targets(run_drill(cp, "device-failure"))


def test_kv_pressure_loses_no_request(cp: Running) -> None:
    report = run_drill(cp, "kv-pressure")
    assert_meets_targets(report)
    assert report["figures"]["rto_slo_s"] is not None  # the SLO held (or came back) under the pressure


def test_replica_hang_is_survived_through_the_gateways_timeouts(cp: Running) -> None:
    report = run_drill(cp, "replica-hang")
    assert_meets_targets(report)
    fig = report["figures"]
    # At 4 req/s the hung replica can be idle when the hang takes hold; the gateway's readiness probe
    # then finds it before any request does, and nothing is affected. Either way the gateway noticed.
    if fig["requests_affected"]:
        assert fig["t_detect"] is not None
    assert gateway_saw_stall(cp, report)


def test_link_partition_is_survived_and_the_filter_removed(cp: Running) -> None:
    report = run_drill(cp, "link-partition")
    assert_meets_targets(report)
    assert gateway_saw_stall(cp, report)  # by a stream, a request waiting there or its readiness probe
    with cp.client() as client:
        assert client.chaos_faults() == []
        target = next(r for r in client.fleet().replicas if r.replica_id == report["fault_targets"][0])
    assert httpx.get(f"{target.url}/health", timeout=5, trust_env=False).status_code == 200


def test_rolling_update_under_load_loses_nothing_and_replaces_every_replica(cp: Running) -> None:
    with cp.client() as client:
        before = client.fleet()
    report = run_drill(cp, "rolling-update", duration_s=12.0)
    assert_meets_targets(report)
    with cp.client() as client:
        after = client.fleet()
    assert after.model != before.model and after.generation == before.generation + 1
    assert {r.replica_id for r in after.replicas if r.generation == after.generation} and \
        all(r.generation == after.generation for r in after.replicas if r.state == "ready")


def test_one_drill_at_a_time_abort_reverts_and_reports_are_listed_compared_and_rendered(cp: Running) -> None:
    with cp.client() as client:
        wait_ready(cp, 2)
        first = client.drill_run("replica-hang", **LOAD).id
        with pytest.raises(ApiError) as busy:
            client.drill_run("replica-crash")
        assert busy.value.status == 409
        # the steady state, the load client's start and fault_at_s, each within its own bound
        hang = SCENARIOS["replica-hang"]
        bound = hang.steady_state_timeout_s + LOAD_START_TIMEOUT_S + LOAD["fault_at_s"] + STREAM_WAIT_S
        deadline = time.monotonic() + bound

        def phase() -> str | None:
            progress = client.drill(first).progress
            return progress.phase if progress else None

        while phase() != "observe":  # the hang is in
            assert time.monotonic() < deadline, client.drill(first)
            time.sleep(0.2)
        assert client.drill_abort(first).aborting
        report = wait_finished(client, first, timeout=60)
        assert report["status"] == "aborted"
        assert client.chaos_faults() == []  # the hang was reverted on the way out
        listed = client.drills(limit=20)
        assert listed[0].id == first and len(listed) >= 2
        done = [d.id for d in listed if d.status in ("passed", "failed")][:2]
        table = client.drill_compare(done)
        assert [c.id for c in table.columns] == done
        row = next(r for r in table.rows if r.figure == "rto_service_s")
        assert all(isinstance(v, float) for v in row.values)
        markdown = client.drill_markdown(done[0])
        assert "| RTO service |" in markdown and "## Verdict" in markdown
        figure = timeline_figure(client.drill(done[0]).document)
        assert figure["layout"]["shapes"][0]["x0"] == 0.0
        assert any(a["text"] == "t_capacity" for a in figure["layout"]["annotations"])
        audit = [a for a in client.audit(limit=200) if a.action == "drill.run"]
        assert {"ok", "denied"} <= {a.outcome for a in audit}
        viewer = client.issue_token("drill-viewer", "viewer")
    with ControlPlaneClient(cp.api, viewer) as as_viewer:
        assert as_viewer.drills(limit=1)
        with pytest.raises(ApiError) as refused:
            as_viewer.drill_run("replica-crash")
        assert refused.value.status == 403
    bad = httpx.post(f"{cp.api}/api/v1/drills/run", json={"scenario": "nope"}, trust_env=False,
                     headers={"Authorization": f"Bearer {TOKEN}"})
    assert bad.status_code == 400
    assert set(bad.json()["error"]) == {"message", "type", "param", "code"}
    cli = subprocess.run([sys.executable, "-m", "controlplane", "--url", cp.api, "--token", TOKEN, "drill",
                          "list"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and str(first) in cli.stdout and "aborted" in cli.stdout
    shown = subprocess.run([sys.executable, "-m", "controlplane", "--url", cp.api, "--token", TOKEN, "drill",
                            "show", str(done[0]), "--markdown"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.startswith(f"# Drill {done[0]}")
    json.dumps(figure)  # the console gets it through JSON


def test_replica_crash_aimed_at_a_named_replica_under_trace_load_hits_it_and_replays_the_trace(
        cp: Running) -> None:
    """Aimed at the last replica by id (with no traffic the default would pick the first zone's), under 10 s
    of load replaying the first 20 s of the Azure trace twice as fast (31 requests, about 3 a second), token
    counts a tenth of the trace's, capped at max_tokens."""
    with cp.client() as client:
        wait_ready(cp, 2)
        named = max(r.replica_id for r in client.fleet().replicas if r.state == "ready")
    load = {"kind": "trace", "trace": "azure", "compress": 2.0, "token_scale": 0.1}
    cli = subprocess.run([sys.executable, "-m", "controlplane", "--url", cp.api, "--token", TOKEN, "drill",
                          "run", "replica-crash", "--replica", named, "--trace", "azure",
                          "--compress", "2", "--token-scale", "0.1", "--duration", "10", "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    plan = json.loads(cli.stdout)
    assert plan["targets_resolved"]["replicas"] == [named] and plan["faults"][0]["targets"] == [named]
    window = [r for r in read_trace(AZURE) if r.offset < 10.0 * 2.0]
    assert plan["load"]["kind"] == "trace" and plan["load"]["requests"] == len(window) == 31

    report = run_drill(cp, "replica-crash", rate=None, replicas=[named], load=load)
    assert report["targets_requested"] == {"replicas": [named], "zones": []}
    assert report["targets_resolved"]["replicas"] == [named]
    assert report["fault_targets"] == [named]
    kills = [e for e in report["events"] if e["what"] == "fault injected"]
    assert [e["targets"] for e in kills] == [[named]]
    assert report["load"]["kind"] == "trace" and report["load"]["path"] == str(AZURE.resolve())
    assert f"--dataset trace:{AZURE.resolve()}" in report["load"]["command"]
    # the load client sent the trace's requests: its arrivals (compressed) and token counts (scaled)
    records = sorted(read_jsonl(Path(report["load"]["jsonl"])), key=lambda r: r.index)
    assert [r.index for r in records] == list(range(len(records)))
    assert len(window) - 1 <= len(records) <= len(window)  # the last arrives 50 ms before the load's end
    for r in records:
        row = window[r.index]
        assert r.scheduled_time == pytest.approx(row.offset / 2.0)
        assert r.output_len == min(max(1, round(row.generated_tokens * 0.1)), LOAD["max_tokens"])
        assert r.prompt_len == min(max(1, round(row.context_tokens * 0.1)), 512)
    assert report["figures"]["requests_total"] == len(records)
    assert_meets_targets(report)


def processes_serving(model: Path) -> set[int]:
    """Replica processes started with ``--model`` inside ``model``'s folder."""
    return processes(lambda cmd, _: b"inference" in cmd and str(model).encode() in cmd)


def test_a_rollout_whose_new_model_crashes_at_start_rolls_back_under_load_with_no_failed_stream(
        cp: Running, tmp_path: Path) -> None:
    """A new model folder whose config is broken: its replica exits at start. The rollout rolls back, the
    old replicas keep serving the load client throughout, and nothing of the new model is left running."""
    broken = tmp_path / "v2" / "default"  # same model name as the one served
    broken.mkdir(parents=True)
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 512}))
    with cp.client() as client:
        wait_ready(cp, 2)
        before = client.fleet()
        last_event = max((e.id for e in client.events(limit=1)), default=0)
    load_log = tmp_path / "load.log"
    jsonl = tmp_path / "load.jsonl"
    command = [sys.executable, "-m", "inference.bench", "serve", "--base-url", cp.gateway, "--seed", "0",
               "--request-rate", "4", "--num-requests", "200", "--duration", "15", "--grace", "20",
               "--input-len", "32", "--output-len", "16", "--jsonl", str(jsonl), "--no-progress"]
    with load_log.open("wb") as log:
        load = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        with cp.client() as client:
            flowing = poll(lambda: sum(n for g in client.gateways() for n in g.inflight.values()), bool,
                           timeout=60)
            assert flowing, f"the load never reached the gateway: {load_log.read_text()[-2000:]}"
            started = client.rollout(str(broken))
            assert started.generation == before.generation + 1
            rolled_back = poll(lambda: client.events(since_id=last_event, kind="rollout.rolled_back"), bool,
                               timeout=60)
            assert rolled_back, "no rollback within 60 s"
            assert rolled_back[0].detail["reason"] == "new replica crashed"
            assert load.wait(timeout=60) == 0, load_log.read_text()[-2000:]
            after = poll(client.fleet, lambda f: f.ready_replicas == 2 and f.rollout is None, timeout=60)
            gone = poll(lambda: processes_serving(broken), lambda pids: not pids, timeout=30)
    finally:
        if load.poll() is None:
            load.kill()
    assert (after.model, after.generation) == (before.model, before.generation)
    assert {r.replica_id for r in after.replicas} == {r.replica_id for r in before.replicas}
    assert gone == set(), f"replicas of the rolled-back model still run: {gone}"
    records = read_jsonl(jsonl)
    during = [r for r in records if rolled_back[0].ts - 5 <= r.send_wall <= rolled_back[0].ts]
    assert len(records) > 20 and during, "the load did not span the rollout"
    assert [r.request_id for r in records if not r.is_success] == []
    assert all(r.completion_tokens == r.output_len for r in records)  # no stream cut or padded
