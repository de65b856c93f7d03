"""Every shipped drill scenario against a real fleet under load, through a real ``controlplane up``.

One control plane (two replicas, the default model; autoscaler, alerts and console off so that nothing else
moves the fleet) serves the whole module. Each drill runs the real load client as a separate process
against the gateway; the test reads that client's JSONL itself and checks the report's figures against it.
"""

from __future__ import annotations

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
from controlplane.client import ApiError, ControlPlaneClient
from controlplane.drills.report import timeline_figure
from inference.bench.datasets import read_trace
from inference.bench.report import read_jsonl
from inference.launcher import free_port

from .conftest import Running, shutdown, start, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

TOKEN = "admin-token-for-drill-tests"
FINISHED = ("passed", "failed", "aborted", "error", "interrupted")
LOAD: dict[str, Any] = {"rate": 4.0, "duration_s": 10.0, "fault_at_s": 3.0, "max_tokens": 16}
AZURE = Path("/work/shared/data/azure_llm_conv_2023.csv")  # the Azure LLM conversation trace (2023)


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


def wait_finished(client: ControlPlaneClient, drill_id: int, *, timeout: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = client.drill(drill_id)
        if report["status"] in FINISHED:
            return report
        time.sleep(1.0)
    raise AssertionError(f"drill {drill_id} still {report['status']} after {timeout:g}s: "
                         f"{report.get('progress')}")


def run_drill(cp: Running, scenario: str, **overrides: Any) -> dict[str, Any]:
    with cp.client() as client:
        wait_ready(cp, 2)
        started = client.drill_run(scenario, **{**LOAD, **overrides})
        report = wait_finished(client, int(started["id"]))
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
    return any(e["subject"] == target and e["ts"] >= report["t0"] for e in events)


def test_replica_crash_loses_no_request_and_serves_again_within_a_second(cp: Running) -> None:
    report = run_drill(cp, "replica-crash")
    fig = report["figures"]
    assert fig["requests_failed"] == 0 and fig["tokens_lost"] == 0 and fig["tokens_duplicated"] == 0
    assert fig["rto_service_s"] < 1.0
    # Resumes are counted, not required: a request the crash caught may have been moved before its first
    # token, or read to its end by the gateway already. Resuming mid-stream is asserted where a replica
    # is killed while it is still generating (tests/controlplane/gateway/test_failover.py).
    assert fig["requests_resumed"] is not None and fig["requests_resumed"] >= 0
    assert fig["rto_capacity_s"] is not None and fig["rto_capacity_s"] > 0
    assert report["prediction"]["rto_capacity_s"] is not None
    assert report["status"] == "passed"


def test_zone_outage_kills_one_zone_and_loses_nothing(cp: Running) -> None:
    report = run_drill(cp, "zone-outage")
    fig = report["figures"]
    zones = {t.rsplit("-", 1)[0] for t in report["fault_targets"]}
    assert len(zones) == 1
    assert fig["requests_failed"] == 0 and fig["tokens_lost"] == 0
    assert fig["requests_resumed"] is not None and fig["rto_capacity_s"] is not None  # see the crash test
    # measured 0.48-0.96 s here with two replicas on two shared cores; the crash test holds the 1 s line
    assert fig["rto_service_s"] < 2.0


def test_device_failure_loses_no_request(cp: Running) -> None:
    fig = run_drill(cp, "device-failure")["figures"]
    assert fig["requests_failed"] == 0 and fig["tokens_lost"] == 0
    assert fig["rto_capacity_s"] is not None


def test_kv_pressure_loses_no_request(cp: Running) -> None:
    fig = run_drill(cp, "kv-pressure")["figures"]
    assert fig["requests_failed"] == 0 and fig["tokens_lost"] == 0
    assert fig["rto_slo_s"] is not None


def test_replica_hang_is_survived_through_the_gateways_timeouts(cp: Running) -> None:
    report = run_drill(cp, "replica-hang")
    fig = report["figures"]
    assert fig["requests_failed"] == 0 and fig["tokens_lost"] == 0
    # At 4 req/s the hung replica can be idle when the hang takes hold; the gateway's readiness probe
    # then finds it before any request does, and nothing is affected. Either way the gateway noticed.
    if fig["requests_affected"]:
        assert fig["t_detect"] is not None
    assert gateway_saw_stall(cp, report)
    assert fig["rto_service_s"] <= report["config"]["targets"]["rto_service_s"]


def test_link_partition_is_survived_and_the_filter_removed(cp: Running) -> None:
    report = run_drill(cp, "link-partition")
    fig = report["figures"]
    assert fig["requests_failed"] == 0 and fig["tokens_lost"] == 0
    assert gateway_saw_stall(cp, report)  # by a stream, a request waiting there or its readiness probe
    assert fig["rto_service_s"] <= report["config"]["targets"]["rto_service_s"]
    with cp.client() as client:
        assert client.chaos_faults() == []
        target = next(r for r in client.fleet().replicas if r.replica_id == report["fault_targets"][0])
    assert httpx.get(f"{target.url}/health", timeout=5, trust_env=False).status_code == 200


def test_rolling_update_under_load_loses_nothing_and_replaces_every_replica(cp: Running) -> None:
    with cp.client() as client:
        before = client.fleet()
    report = run_drill(cp, "rolling-update", duration_s=12.0)
    fig = report["figures"]
    assert fig["requests_failed"] == 0 and fig["tokens_lost"] == 0 and fig["tokens_duplicated"] == 0
    assert fig["rto_capacity_s"] is not None
    with cp.client() as client:
        after = client.fleet()
    assert after.model != before.model and after.generation == before.generation + 1
    assert {r.replica_id for r in after.replicas if r.generation == after.generation} and \
        all(r.generation == after.generation for r in after.replicas if r.state == "ready")


def test_one_drill_at_a_time_abort_reverts_and_reports_are_listed_compared_and_rendered(cp: Running) -> None:
    with cp.client() as client:
        wait_ready(cp, 2)
        first = int(client.drill_run("replica-hang", **LOAD)["id"])
        with pytest.raises(ApiError) as busy:
            client.drill_run("replica-crash")
        assert busy.value.status == 409
        deadline = time.monotonic() + 60
        while (client.drill(first).get("progress") or {}).get("phase") != "observe":  # the hang is in
            assert time.monotonic() < deadline, client.drill(first)
            time.sleep(0.2)
        assert client.drill_abort(first)["aborting"]
        report = wait_finished(client, first, timeout=60)
        assert report["status"] == "aborted"
        assert client.chaos_faults() == []  # the hang was reverted on the way out
        listed = client.drills(limit=20)
        assert listed[0]["id"] == first and len(listed) >= 2
        done = [d["id"] for d in listed if d["status"] in ("passed", "failed")][:2]
        table = client.drill_compare(done)
        assert [c["id"] for c in table["columns"]] == done
        row = next(r for r in table["rows"] if r["figure"] == "rto_service_s")
        assert all(isinstance(v, float) for v in row["values"])
        markdown = client.drill_markdown(done[0])
        assert "| RTO service |" in markdown and "## Verdict" in markdown
        figure = timeline_figure(client.drill(done[0]))
        assert figure["layout"]["shapes"][0]["x0"] == 0.0
        assert any(a["text"] == "t_capacity" for a in figure["layout"]["annotations"])
        audit = [a for a in client.audit(limit=200) if a["action"] == "drill.run"]
        assert {"ok", "denied"} <= {a["outcome"] for a in audit}
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
    load = {"kind": "trace", "trace": str(AZURE), "compress": 2.0, "token_scale": 0.1}
    cli = subprocess.run([sys.executable, "-m", "controlplane", "--url", cp.api, "--token", TOKEN, "drill",
                          "run", "replica-crash", "--replica", named, "--trace", str(AZURE),
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
    fig = report["figures"]
    assert fig["requests_total"] == len(records)
    assert fig["requests_failed"] == 0 and fig["tokens_lost"] == 0 and fig["tokens_duplicated"] == 0
    assert report["status"] in ("passed", "failed")
