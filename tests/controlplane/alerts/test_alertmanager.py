"""The real Prometheus tools drive our alerts: Alertmanager posts to our receiver, promtool checks the export.

The control plane's REST API runs in uvicorn on a free loopback port; Debian's ``prometheus-alertmanager``
runs as a child process (temporary config and storage, clustering off) with a webhook receiver pointing at
``/api/v1/alerts/webhook`` and an operator token as its bearer credentials. The fleet is the real
:class:`Fleet` on the simulated backend of ``test_fleet``: what an Alertmanager ``scale_up`` changes is the
fleet's desired count, and starting real replica processes would add minutes without testing more of the
alert path (``tests/controlplane/up`` covers real replicas).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from controlplane.alerts.config import AlertRuleConfig, AlertsConfig
from controlplane.alerts.engine import (
    alert_delegation,
    build_engine,
    default_rules,
    rule_file,
    rule_file_writer,
    rule_switches,
)
from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.client import AlertTransition, ControlPlaneClient
from controlplane.config import Config
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.reconcile import Fleet
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.store.database import Store
from controlplane.telemetry.config import PrometheusConfig
from controlplane.telemetry.prometheus_server import PrometheusServer
from inference.launcher import free_port
from tests.controlplane.fleet.test_reconcile import SimBackend
from tests.polling import wait_until

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.timeout(120)


@dataclass
class Served:
    url: str
    fleet: Fleet
    store: Store
    operator_token: str
    viewer_token: str


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """The control plane's API (with the alert engine) in uvicorn on 127.0.0.1."""
    store = Store(tmp_path / "state.db")

    async def is_ready(_: ReplicaEndpoint) -> bool:
        return True

    fleet = Fleet(FleetConfig(replicas=2, zones=["az-a", "az-b"], base_port=free_port()), SimBackend(), store,
                  secret=b"s" * 32, ready_probe=is_ready)
    for _ in range(2):  # spawn, then probe: two replicas READY (simulated; nothing listens on their ports)
        asyncio.run(fleet.reconcile())
    tokens, auditor = TokenAuthority(store), Auditor(store)
    engine = build_engine(AlertsConfig(), store=store, auditor=auditor, telemetry=None, fleet=fleet)
    app = create_api(Services(fleet, store, tokens, auditor, alerts=engine))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="api", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=20, what="the API to listen")
        yield Served(f"http://127.0.0.1:{port}", fleet, store, tokens.issue("alertmanager", Role.OPERATOR),
                     tokens.issue("sre", Role.VIEWER))
    finally:
        server.should_exit = True
        thread.join(20)
        store.close()


@pytest.fixture
def alertmanager(tmp_path: Path, served: Served) -> Iterator[str]:
    """A real Alertmanager whose only receiver is our webhook; stopped (and reaped) at the end."""
    if ALERTMANAGER is None:
        pytest.fail("prometheus-alertmanager is not installed (apt install prometheus-alertmanager)")
    credentials = tmp_path / "am-token"
    credentials.write_text(served.operator_token)
    credentials.chmod(0o600)
    config = tmp_path / "alertmanager.yml"
    config.write_text(f"""
route:
  receiver: controlplane
  group_by: [alertname]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: controlplane
    webhook_configs:
      - url: "{served.url}/api/v1/alerts/webhook"
        send_resolved: true
        http_config:
          authorization:
            type: Bearer
            credentials_file: "{credentials}"
""")
    port = free_port()
    log = (tmp_path / "alertmanager.log").open("wb")
    process = subprocess.Popen([ALERTMANAGER, f"--config.file={config}", f"--storage.path={tmp_path / 'am'}",
                                f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert process.poll() is None, (tmp_path / "alertmanager.log").read_text()[-2000:]
            try:
                return httpx.get(f"{url}/-/ready", timeout=1, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=30, what="alertmanager to be ready", interval=0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        log.close()
    assert process.returncode is not None


def _post_alert(url: str, labels: dict[str, str], *, ends_at: dt.datetime | None = None) -> None:
    now = dt.datetime.now(dt.UTC)
    alert: dict[str, Any] = {"labels": labels, "annotations": {"summary": "P95 TTFT above 5 s"},
                             "startsAt": (now - dt.timedelta(seconds=5)).isoformat(),
                             "generatorURL": "http://127.0.0.1:9090/graph"}
    if ends_at is not None:
        alert["endsAt"] = ends_at.isoformat()
    response = httpx.post(f"{url}/api/v2/alerts", json=[alert], timeout=5, trust_env=False)
    assert response.status_code == 200, response.text


def test_alertmanager_drives_scale_up_through_our_receiver_once(served: Served, alertmanager: str) -> None:
    labels = {"alertname": "SlowTimeToFirstToken", "action": "scale_up", "severity": "warning"}
    assert served.fleet.desired_total == 2
    _post_alert(alertmanager, labels)
    wait_until(lambda: served.fleet.desired_total == 3, timeout=30, what="the scale-up from alertmanager")

    def audited() -> list[tuple[str, str, str, str]]:
        audit: list[tuple[str, str, str, str]] = [(a.actor, a.action, a.target, a.outcome)
                                                  for a in served.store.audit()]
        return audit if ("alertmanager", "alerts.webhook", "controlplane", "ok") in audit else []

    assert ("alerts", "alerts.scale_up", "fleet", "ok") in wait_until(audited, timeout=10,
                                                                     what="the webhook's audit record")

    _post_alert(alertmanager, labels)  # the same alert again: Alertmanager dedups, we act once per firing
    _post_alert(alertmanager, labels, ends_at=dt.datetime.now(dt.UTC))  # and now it is over

    def resolved() -> list[AlertTransition]:
        with ControlPlaneClient(served.url, served.viewer_token) as client:
            return [r for r in client.alert_history() if r.state == "resolved"]

    (record,) = wait_until(resolved, timeout=30, what="the resolved notification")
    assert (record.rule, record.source) == ("SlowTimeToFirstToken", "alertmanager")
    assert served.fleet.desired_total == 3
    with ControlPlaneClient(served.url, served.viewer_token) as client:
        assert client.active_alerts() == []
        firing = [r for r in client.alert_history() if r.state == "firing"]
    assert len(firing) == 1
    assert firing[0].result is not None and firing[0].result.outcome == "ok"


def test_prometheus_and_alertmanager_restart_a_replica_that_stopped_answering(
        served: Served, alertmanager: str, tmp_path: Path) -> None:
    """The whole delegated path: our rule file in a real Prometheus, its alert through a real Alertmanager,
    our receiver restarting the replica. The simulated replicas never answer /metrics, so ``up`` is 0."""
    rule = AlertRuleConfig(name="ReplicaDown", query="replica_up", comparison="<", threshold=1, for_s=2,
                           severity="critical", action="restart_replica")
    config = Config(state_dir=str(tmp_path / "cp"), alerts=AlertsConfig(
        default_rules=False, rules=[rule], eval_interval_s=1, alertmanager_url=alertmanager))
    delegation = alert_delegation(config.alerts, config.state_path)
    prometheus = PrometheusServer(PrometheusConfig(port=free_port(), scrape_interval_s=1.0),
                                  tmp_path / "cp" / "prometheus", **delegation)
    assert prometheus.validate_config()  # promtool check config: rule_files and alerting included
    assert {e.state for e in served.fleet.endpoints()} == {ReplicaState.READY}
    prometheus.start(served.fleet.endpoints())
    try:
        def restarted() -> set[str]:
            done = {a.target for a in served.store.audit()
                    if (a.actor, a.action, a.outcome) == ("alerts", "alerts.restart_replica", "ok")}
            return done if done == {"az-a-1", "az-b-1"} else set()

        wait_until(restarted, timeout=60, what="alertmanager to have both replicas restarted", interval=0.2)
    finally:
        prometheus.stop()
    events = [e.subject for e in served.store.events(kind_prefix="replica.restart_requested")]
    assert sorted(events) == ["az-a-1", "az-b-1"]
    firing = [r for r in served.store.records("alerts") if r.body["state"] == "firing"]
    assert {r.body["labels"]["replica"] for r in firing} == {"az-a-1", "az-b-1"}
    assert {r.body["source"] for r in firing} == {"alertmanager"}


def test_a_rule_disabled_through_the_api_leaves_the_prometheus_that_evaluates_it(
        alertmanager: str, tmp_path: Path) -> None:
    """Delegated rules live in a real Prometheus: switching one off rewrites its rule file and reloads it,
    or Prometheus would go on firing it to Alertmanager."""
    config = Config(state_dir=str(tmp_path / "cp"), alerts=AlertsConfig(eval_interval_s=1,
                                                                        alertmanager_url=alertmanager))
    store = Store(tmp_path / "state.db")
    engine = build_engine(config.alerts, store=store, auditor=Auditor(store), telemetry=None, fleet=None)
    delegation = alert_delegation(config.alerts, config.state_path, rule_switches(store))
    prometheus = PrometheusServer(PrometheusConfig(port=free_port(), scrape_interval_s=1.0),
                                  tmp_path / "cp" / "prometheus", **delegation)
    engine.on_rules_changed = rule_file_writer(delegation["rule_files"][0], prometheus.reload)

    def loaded() -> set[str]:
        groups = httpx.get(f"{prometheus.url}/api/v1/rules", timeout=5).json()["data"]["groups"]
        return {rule["name"] for group in groups for rule in group["rules"]}

    async def switch(enabled: bool) -> None:
        engine.set_enabled("ReplicaDown", enabled)
        await asyncio.sleep(0)

    prometheus.start([])
    try:
        every = {r.name for r in default_rules()}
        wait_until(lambda: loaded() == every, timeout=30, what="Prometheus to load the rules")
        asyncio.run(switch(False))
        wait_until(lambda: loaded() == every - {"ReplicaDown"}, timeout=30,
                   what="Prometheus to drop the disabled rule")
        asyncio.run(switch(True))
        wait_until(lambda: loaded() == every, timeout=30, what="Prometheus to take the rule back")
    finally:
        prometheus.stop()
        store.close()


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        pytest.fail("promtool is not installed (apt install prometheus)")
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False)


def test_exported_rules_pass_promtool_check_rules(served: Served, tmp_path: Path) -> None:
    from_api = tmp_path / "api-rules.yml"
    with ControlPlaneClient(served.url, served.viewer_token) as client:
        from_api.write_text(client.alert_rules_yml())
    from_cli = tmp_path / "cli-rules.yml"
    with from_cli.open("w") as out:  # `controlplane alerts export > rules.yml`, offline from the defaults
        done = subprocess.run([sys.executable, "-m", "controlplane", "alerts", "export", "--defaults"],
                              stdout=out, stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert from_cli.read_text() == from_api.read_text()
    checked = _promtool("check", "rules", str(from_api))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(default_rules())} rules found" in checked.stdout


def test_exported_promql_fires_on_the_series_it_is_meant_for(tmp_path: Path) -> None:
    """``promtool test rules``: Prometheus' own evaluator runs the exported rules on synthetic series."""
    (tmp_path / "rules.yml").write_text(rule_file(default_rules(), interval_s=5))
    (tmp_path / "test.yml").write_text("""
rule_files: [rules.yml]
evaluation_interval: 5s
tests:
  - interval: 15s
    input_series:
      - series: 'vllm:num_requests_waiting{job="replicas",replica="az-a-1"}'
        values: '300x20'
      - series: 'vllm:num_requests_waiting{job="replicas",replica="az-b-1"}'
        values: '300x20'
      - series: 'vllm:kv_cache_usage_perc{job="replicas",replica="az-a-1"}'
        values: '0.5x20'
      - series: 'vllm:kv_cache_usage_perc{job="replicas",replica="az-b-1"}'
        values: '0.5x20'
      - series: 'up{job="replicas",replica="az-a-1"}'
        values: '1x20'
      - series: 'up{job="replicas",replica="az-b-1"}'
        values: '1 1 0x18'
    alert_rule_test:
      - eval_time: 45s
        alertname: LongQueue
        exp_alerts: []
      - eval_time: 75s
        alertname: LongQueue
        exp_alerts:
          - exp_labels: {severity: warning, action: scale_up}
            exp_annotations:
              summary: "more than 500 requests waiting"
              description: "LongQueue: value 600 > 500"
      - eval_time: 75s
        alertname: KVCacheFull
        exp_alerts: []
      - eval_time: 60s
        alertname: ReplicaDown
        exp_alerts:
          - exp_labels: {severity: critical, action: restart_replica, replica: az-b-1}
            exp_annotations:
              summary: "a replica's metrics endpoint does not answer"
              description: "ReplicaDown: value 0 < 1"
""")
    done = _promtool("test", "rules", str(tmp_path / "test.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_cli_lists_rules_history_and_switches_a_rule(served: Served, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from controlplane.cli.main import main

    token = tmp_path / "operator.token"  # not in argv: ps shows it
    token.write_text(served.operator_token)
    token.chmod(0o600)
    base = ["--url", served.url, "--token-file", str(token), "alerts"]
    assert main([*base, "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split()[:4] == ["RULE", "ON", "CONDITION", "FOR"]
    assert any(line.split()[:4] == ["ReplicaDown", "yes", "<", "1"] for line in listed)
    assert main([*base, "disable", "KVCacheFull"]) == 0
    assert capsys.readouterr().out == "KVCacheFull: disabled\n"
    assert main([*base, "active"]) == 0
    assert capsys.readouterr().out == "no active alerts\n"
    assert main([*base, "disable", "NoSuchRule"]) == 1  # refused: exit code 1
    assert capsys.readouterr().err == "controlplane: HTTP 404: no alert rule named 'NoSuchRule'\n"
    assert main([*base, "export"]) == 0
    exported = capsys.readouterr().out
    assert 'alert: "ReplicaDown"' in exported and "KVCacheFull" not in exported
    audit = [(a.actor, a.action, a.target, a.outcome) for a in served.store.audit()]
    assert ("alertmanager", "alerts.disable", "KVCacheFull", "ok") in audit
