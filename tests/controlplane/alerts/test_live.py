"""Alerts against live endpoints: the notify webhook posting to a real HTTP server, and a real control plane.

The notify webhook is a real HTTP server on 127.0.0.1 (a thread of this process); the rules are evaluated
on the fake telemetry and simulated clock of ``test_alerts`` (imported from there, not copied). The slow
test runs a real ``controlplane up`` (one replica, Prometheus as the telemetry source), freezes its replica
with SIGSTOP and checks that the ReplicaDown alert restarts it; it leaves no process behind.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest

from controlplane.alerts.config import AlertRuleConfig, AlertsConfig
from controlplane.alerts.engine import build_engine, default_rules
from controlplane.auth import Auditor
from controlplane.store.database import Store
from inference.launcher import free_port
from tests.controlplane.alerts.test_engine import FakeTelemetry
from tests.controlplane.conftest import FakeClock


# ---- notify webhook -------------------------------------------------------------------------------
@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict[str, Any]], dict[str, int]]]:
    received: list[dict[str, Any]] = []
    answer = {"status": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            received.append(json.loads(self.rfile.read(length)))
            self.send_response(answer["status"])
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", received, answer
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _notify_config(url: str) -> AlertsConfig:
    return AlertsConfig(default_rules=False, webhook_url=url, notify_timeout_s=2.0, rules=[
        AlertRuleConfig(name="QueueBuilds", query="num_waiting", threshold=10, for_s=0, action="notify",
                        summary="queue builds up")])


def test_notify_posts_the_alert_as_json_to_the_webhook(store: Store, clock: FakeClock, webhook: Any) -> None:
    url, received, _ = webhook
    engine = build_engine(_notify_config(f"{url}?key=s3cret"), store=store, auditor=Auditor(store),
                          telemetry=(t := FakeTelemetry()), fleet=None, clock=clock)
    t.waiting = 42
    asyncio.run(engine.evaluate_once())
    assert len(received) == 1
    # The URL's secret reaches the webhook, never the audit trail or the alert history.
    assert [a.target for a in store.audit()] == [url]
    assert engine.history()[0]["result"]["target"] == url
    body = received[0]
    assert (body["alert"], body["state"], body["value"]) == ("QueueBuilds", "firing", 42)
    assert body["labels"]["severity"] == "warning"
    assert body["annotations"]["summary"] == "queue builds up"
    assert engine.history()[0]["result"]["outcome"] == "ok"


def test_failing_webhooks_are_recorded_and_the_loop_goes_on(store: Store, clock: FakeClock,
                                                           webhook: Any) -> None:
    url, _, answer = webhook
    answer["status"] = 500
    dead = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there
    config = _notify_config(url)
    config.rules.append(AlertRuleConfig(name="QueueBuildsToo", query="num_waiting", threshold=10, for_s=0,
                                        action="notify", webhook_url=dead))
    engine = build_engine(config, store=store, auditor=Auditor(store), telemetry=(t := FakeTelemetry()),
                          fleet=None, clock=clock)
    t.waiting = 42
    asyncio.run(engine.evaluate_once())
    results = {r["rule"]: r["result"] for r in engine.history()}
    assert results["QueueBuilds"]["outcome"] == "error"
    assert results["QueueBuilds"]["detail"] == "webhook answered 500"
    assert results["QueueBuildsToo"]["outcome"] == "error"
    assert "ConnectError" in results["QueueBuildsToo"]["detail"]
    assert [a.outcome for a in store.audit() if a.action == "alerts.notify"] == ["error", "error"]
    t.waiting = 0
    clock.now += 5
    assert {t.state for t in asyncio.run(engine.evaluate_once())} == {"resolved"}


# ---- live: `controlplane up` with the real Prometheus ---------------------------------------------
LIVE_RULES = """
[alerts]
eval_interval_s = 1.0
[[alerts.rules]]
name = "ReplicaDown"
query = "replica_up"
comparison = "<"
threshold = 1
for_s = 3
severity = "critical"
action = "restart_replica"
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_live_control_plane_restarts_a_replica_that_stops_answering(tmp_path: Path) -> None:
    """A real `controlplane up` (one replica, Prometheus as the telemetry source) evaluates the PromQL of
    its rules; a replica frozen with SIGSTOP stops answering scrapes and the alert restarts it."""
    import contextlib
    import os
    import signal
    import subprocess
    import time

    from inference.models.default import ensure_default_model
    from tests.controlplane.up.conftest import replica_pids, start, wait_ready, write_config
    from tests.polling import wait_until

    ensure_default_model(tmp_path / "state")
    config = write_config(tmp_path, replicas=1, alerts=True)
    config.write_text(config.read_text() + LIVE_RULES)
    running = start(config, tmp_path, "admin-token-for-alert-tests")
    frozen: int | None = None
    frozen_process: psutil.Process | None = None
    try:
        wait_ready(running, 1)
        with running.client() as client:
            (replica,) = client.fleet().replicas
            evaluated = wait_until(lambda: [r for r in client.alert_rules() if r.last_eval], timeout=30,
                                   what="the first evaluation", interval=0.5)
            # Every rule's PromQL answered by the real Prometheus, without an error.
            assert {r.name: r.last_error for r in evaluated} == dict.fromkeys(
                (r.name for r in default_rules()), "")
            frozen = replica.pid
            assert frozen is not None
            frozen_process = psutil.Process(frozen)  # signalled again only while it is this process
            frozen_process.send_signal(signal.SIGSTOP)
            frozen_at = time.time()
            # (When up was 0 while the replica started, that firing's restart was deferred, since the fleet
            # was starting it; it is tried again now, on a ready replica that does not answer.)
            history = wait_until(lambda: [r for r in client.alert_history() if r.result
                                          and r.result.at >= frozen_at], timeout=120,
                                 what="the alert to fire and act", interval=0.5)
            assert history[0].labels["replica"] == replica.replica_id
            assert history[0].result is not None and history[0].result.outcome == "ok", history[0].result
            wait_until(lambda: any(r.pid != frozen and r.state == "ready" for r in client.fleet().replicas),
                       timeout=150, what="the restarted replica to be ready", interval=0.5)
            assert not psutil.pid_exists(frozen) or psutil.Process(frozen).status() == psutil.STATUS_ZOMBIE
            # the episode that fired resolves (on a loaded host another rule may also go pending while
            # the new replica starts, and resolve without firing: that record is not this one)
            resolved = wait_until(lambda: [r for r in client.alert_history()
                                           if r.state == "resolved" and r.at >= frozen_at and r.fired
                                           and r.labels.get("replica") == replica.replica_id],
                                  timeout=60, what="the alert that fired to resolve", interval=0.5)
            assert resolved[0].rule == history[0].rule
            audit = [(a.actor, a.action, a.target) for a in client.audit()]
            assert ("alerts", "alerts.restart_replica", replica.replica_id) in audit
    finally:
        if frozen_process is not None and frozen_process.is_running():
            # not by pid: the alert's restart reaps the frozen replica, and on a busy host its pid can run
            # another test's process by now (one stopped on purpose, whose test a SIGCONT would break)
            with contextlib.suppress(psutil.NoSuchProcess):
                frozen_process.send_signal(signal.SIGCONT)
        if running.process.poll() is None:
            running.process.send_signal(signal.SIGTERM)
            try:
                running.process.wait(60)
            except subprocess.TimeoutExpired:
                running.process.kill()
                running.process.wait(10)
        for pid in replica_pids(running.state_dir):
            os.kill(pid, signal.SIGKILL)
