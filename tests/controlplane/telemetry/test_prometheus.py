"""PrometheusServer writes a configuration promtool accepts, follows the fleet through a targets file,
never leaves its process behind; PrometheusSource speaks PromQL and reports failures as TelemetryError."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import psutil
import pytest

from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.telemetry.base import Regex, TelemetryError
from controlplane.telemetry.config import PrometheusConfig
from controlplane.telemetry.prometheus import PrometheusSource
from controlplane.telemetry.prometheus_server import (
    UNAVAILABLE,
    GuardedPage,
    PrometheusError,
    PrometheusServer,
    PrometheusUnavailable,
)
from controlplane.telemetry.promql import duration, gauge_query, quantile_query, rate_query, selector
from inference.launcher import free_port

from .conftest import pid_exists, prometheus_config

ENDPOINTS = [
    ReplicaEndpoint("r2", "az-b", "127.0.0.1", 8102, ReplicaState.READY, "default"),
    ReplicaEndpoint("r1", "az-a", "127.0.0.1", 8101, ReplicaState.STARTING, "default"),
    ReplicaEndpoint("r3", "az-c", "127.0.0.1", 8103, ReplicaState.STOPPED, "default"),
    ReplicaEndpoint("r4", "az-c", "127.0.0.1", 8104, ReplicaState.CRASHED, "default"),
]


def server(tmp_path: Path, **fields: object) -> PrometheusServer:
    config = prometheus_config()
    for name, value in fields.items():
        setattr(config, name, value)
    return PrometheusServer(config, tmp_path / "prometheus", static_jobs={"controlplane": ["127.0.0.1:8080"],
                                                                          "gateway": ["127.0.0.1:8000"]})


# ---- configuration ----------------------------------------------------------------------------------
def test_config_scrapes_replicas_by_file_sd_and_the_static_jobs(tmp_path: Path) -> None:
    s = server(tmp_path, scrape_interval_s=2.0)
    text = s.write_config().read_text()
    assert "  scrape_interval: 2s\n" in text and "  evaluation_interval: 2s\n" in text
    assert f'files: ["{s.targets_path}"]' in text and "refresh_interval: 1s" in text
    assert 'job_name: "gateway"' in text and 'targets: ["127.0.0.1:8000"]' in text
    assert 'job_name: "controlplane"' in text and "honor_labels: false" in text
    assert 'regex: "exported_(replica|zone)"' in text  # the page's echo of the target's labels
    assert json.loads(s.targets_path.read_text()) == []  # a fresh start scrapes no replica yet


@pytest.mark.usefixtures("promtool_binary")
@pytest.mark.parametrize("interval", [1.0, 2.0, 0.5])
def test_generated_config_passes_promtool_check(tmp_path: Path, interval: float) -> None:
    s = server(tmp_path, scrape_interval_s=interval)
    s.write_config()
    assert s.validate_config() is True


@pytest.mark.usefixtures("promtool_binary")
def test_promtool_rejects_a_broken_config_with_its_reason(tmp_path: Path) -> None:
    s = server(tmp_path)
    s.write_config()
    s.config_path.write_text(s.config_path.read_text().replace("scrape_configs:", "scrape_cnfigs:"))
    with pytest.raises(PrometheusError, match=r"(?s)promtool check config failed.*scrape_cnfigs"):
        s.validate_config()


def test_targets_file_lists_every_replica_not_stopped_with_its_labels(tmp_path: Path) -> None:
    s = server(tmp_path)
    s.update_targets(ENDPOINTS)
    assert json.loads(s.targets_path.read_text()) == [
        {"targets": ["127.0.0.1:8101"], "labels": {"replica": "r1", "zone": "az-a", "model": "default"}},
        {"targets": ["127.0.0.1:8102"], "labels": {"replica": "r2", "zone": "az-b", "model": "default"}},
        {"targets": ["127.0.0.1:8104"], "labels": {"replica": "r4", "zone": "az-c", "model": "default"}},
    ]
    s.update_targets([])
    assert json.loads(s.targets_path.read_text()) == []
    assert [p.name for p in s.targets_path.parent.iterdir()] == ["replicas.json"]  # no temp file left


def test_missing_binary_is_reported_as_unavailable(tmp_path: Path) -> None:
    s = server(tmp_path, binary="/nonexistent/prometheus")
    assert not s.is_available()
    with pytest.raises(PrometheusUnavailable, match=f"^{UNAVAILABLE}$"):
        s.start()
    assert s.pid is None and not s.is_running


# ---- PromQL -----------------------------------------------------------------------------------------
def test_queries_are_the_promql_an_sre_would_write() -> None:
    assert rate_query("vllm:generation_tokens_total", window_s=30, by=("replica",), match=None) == (
        "sum by (replica) (rate(vllm:generation_tokens_total[30s]))")
    assert quantile_query("vllm:time_to_first_token_seconds", 0.99, window_s=30, by=("replica",),
                          match={"zone": "az-a"}) == (
        'histogram_quantile(0.99, sum by (le, replica) '
        '(rate(vllm:time_to_first_token_seconds_bucket{zone="az-a"}[30s])))')
    assert gauge_query("vllm:kv_cache_usage_perc", by=(), match=None, agg="max") == (
        "max by () (vllm:kv_cache_usage_perc)")
    assert selector("llmsre_http_requests_total", {"status_code": Regex("5.."), "path": 'a"b'}) == (
        'llmsre_http_requests_total{path="a\\"b",status_code=~"5.."}')
    assert duration(1.5) == "1500ms" and duration(60) == "60s"


@pytest.mark.parametrize("bad", [
    lambda: selector("up{} or vector(1)"),
    lambda: selector("up", {"a-b": "x"}),
    lambda: rate_query("up", window_s=0, by=(), match=None),
    lambda: gauge_query("up", by=(), match=None, agg="median"),  # type: ignore[arg-type]
    lambda: quantile_query("h", 1.5, window_s=30, by=(), match=None),
])
def test_malformed_queries_are_refused_before_sending(bad: object) -> None:
    with pytest.raises(ValueError):
        bad()  # type: ignore[operator]


def test_unreachable_prometheus_becomes_one_telemetry_error() -> None:
    source = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    began = time.monotonic()
    with pytest.raises(TelemetryError, match=r"prometheus at http://127\.0\.0\.1") as caught:
        source.gauge("up")
    assert caught.value.__cause__ is not None  # the client's exception is kept in the chain
    assert time.monotonic() - began < 2  # no retries with back-off inside a telemetry read


# ---- the process ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("prometheus_binary")
def test_server_answers_ready_then_stops_and_leaves_no_process(tmp_path: Path) -> None:
    s = server(tmp_path)
    with s:
        pid = s.pid
        assert pid is not None and s.is_running
        assert httpx.get(f"{s.url}/-/ready", trust_env=False).status_code == 200
        assert s.pid_path.read_text().strip() == str(pid)
        source = PrometheusSource(s.url)
        assert source.instant("vector(1)", by=()) == {(): 1.0}
        with pytest.raises(TelemetryError, match=r"bad_data|parse error"):
            source.instant("sum(", by=())
        cmdline = psutil.Process(pid).cmdline()
        assert "--web.enable-lifecycle" not in cmdline
        assert f"--storage.tsdb.path={s.data_path}" in cmdline
        assert f"--storage.tsdb.retention.time={s.config.retention}" in cmdline
    assert not pid_exists(pid)
    assert not s.pid_path.exists()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("prometheus_binary")
def test_leftover_prometheus_of_a_crashed_control_plane_is_stopped_at_start(tmp_path: Path) -> None:
    crashed = server(tmp_path)
    crashed.start()
    leftover = crashed.pid
    assert leftover is not None
    crashed.process = None  # the control plane died without stopping it; the pid file remains
    restarted = PrometheusServer(crashed.config, crashed.state_dir)
    with restarted:
        assert not pid_exists(leftover)
        assert restarted.pid != leftover and restarted.is_running


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("prometheus_binary")
def test_port_taken_by_another_prometheus_fails_start(tmp_path: Path) -> None:
    with server(tmp_path) as first:
        second = PrometheusServer(PrometheusConfig(port=first.config.port), tmp_path / "second",
                                  ready_timeout_s=20)
        with pytest.raises(PrometheusError, match=r"answered by another Prometheus|exited with"):
            second.start()
        assert not second.is_running


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("prometheus_binary")
def test_no_local_process_can_stop_or_reload_it_over_http(tmp_path: Path) -> None:
    """The lifecycle API is off: anyone on the host could otherwise POST /-/quit."""
    with server(tmp_path) as s:
        for path in ("/-/quit", "/-/reload"):
            response = httpx.post(f"{s.url}{path}", trust_env=False, timeout=5)
            assert response.status_code == 403, (path, response.text)
        time.sleep(0.5)
        assert s.is_running and httpx.get(f"{s.url}/-/ready", trust_env=False).status_code == 200


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("prometheus_binary")
def test_reload_by_signal_applies_a_new_job_and_reports_rejected_rules(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text("groups: []\n")
    s = PrometheusServer(prometheus_config(), tmp_path / "prometheus", rule_files=[rules])

    def jobs() -> str:
        config = httpx.get(f"{s.url}/api/v1/status/config", trust_env=False, timeout=5).json()
        return str(config["data"]["yaml"])

    with s:
        assert "extra" not in jobs()
        s.static_jobs["extra"] = ["127.0.0.1:9"]
        s.reload()  # returns once Prometheus says it reloaded
        assert 'job_name: extra' in jobs()
        rules.write_text("groups: [{name: broken, rules: [{alert: X, expr: 'sum('}]}]\n")
        with pytest.raises(PrometheusError, match="rejected the reloaded configuration"):
            s.reload()
        assert s.is_running



@pytest.mark.usefixtures("promtool_binary")
def test_a_guarded_page_is_scraped_with_a_token_file_never_written_into_the_config(tmp_path: Path) -> None:
    token_file = tmp_path / "scrape.token"
    token_file.write_text("secret-for-the-test")
    s = PrometheusServer(prometheus_config(), tmp_path / "prometheus",
                         static_jobs={"controlplane": ["127.0.0.1:8080"], "gateway": ["127.0.0.1:8000"]},
                         guarded_pages={"controlplane": GuardedPage("/metrics/state", token_file)})

    text = s.write_config().read_text()

    controlplane = text.split('job_name: "controlplane"')[1].split("job_name:")[0]
    assert 'metrics_path: "/metrics/state"' in controlplane
    assert f'authorization:\n      type: Bearer\n      credentials_file: "{token_file}"' in controlplane
    assert "authorization" not in text.split('job_name: "gateway"')[1].split("job_name:")[0]
    assert "secret-for-the-test" not in text
    assert s.validate_config() is True
