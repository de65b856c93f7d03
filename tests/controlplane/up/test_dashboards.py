"""The Grafana dashboards against the real thing: ``controlplane up`` (two replicas, a gateway, the
autoscaler observing, the real Prometheus with the recording rules it writes) under a short load through
the gateway. Every query of every panel of ``deploy/grafana/llmsre-fleet.json``, with Grafana's variables
filled in as Grafana would, returns data from that Prometheus; so does every panel of vLLM's own Grafana
example (``tests/deploy/data/vllm_grafana_panels.json``), unchanged. And the scrape configuration gives
each replica series its fleet identity once (no ``exported_*`` copies)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.polling import wait_until

from .conftest import Running, shutdown, start, wait_ready, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "deploy" / "grafana" / "llmsre-fleet.json"
VLLM_PANELS = REPO / "tests" / "deploy" / "data" / "vllm_grafana_panels.json"
SCRAPE_S = 1.0  # what conftest.write_config sets (checked when the config is written)
STEP_S = 1.0
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval).
RATE_INTERVAL = f"{max(STEP_S + SCRAPE_S, 4 * SCRAPE_S):g}s"
CLIENTS = 3
LOAD_REQUESTS = 30  # answered through the gateway before the load stops (about 10 s here)
LOAD_TIMEOUT_S = 90.0
DATA_TIMEOUT_S = 45.0  # recording rules evaluate every second; a stage's first quantile needs two scrapes


@dataclass
class Observed:
    running: Running
    prometheus: str
    since: float  # wall clock when the load began


def _write_config(tmp: Path) -> Path:
    """Two replicas, alerts off, console off, the autoscaler observing every second (it never resizes)."""
    config = write_config(tmp, replicas=2, autoscaler=True)
    config.write_text(config.read_text() + "[console]\nenabled = false\n"
                      "[autoscaler]\ntick_s = 1.0\nobserve_only = true\n")
    return config


def _load(gateway: str, stop: threading.Event, answered: list[int]) -> None:
    """Closed-loop completions, streamed and not in turn (the gateway times a first token on streams)."""
    with httpx.Client(base_url=gateway, timeout=60, trust_env=False) as http:
        stream = False
        while not stop.is_set():
            body = {"prompt": "The dashboard shows", "max_tokens": 12, "ignore_eos": True, "stream": stream}
            with http.stream("POST", "/v1/completions", json=body) as r:
                r.read()
                answered.append(r.status_code)
            stream = not stream


@pytest.fixture(scope="module")
def observed(model_state: Path) -> Iterator[Observed]:
    if shutil.which("prometheus") is None:
        reason = "unavailable: prometheus binary not found"
        if os.environ.get("CI"):  # CI installs it: there, a missing binary is a failure
            pytest.fail(reason)
        pytest.skip(reason)
    config = _write_config(model_state)
    prometheus = tomllib.loads(config.read_text())["prometheus"]
    assert prometheus["scrape_interval_s"] == SCRAPE_S
    port = prometheus["port"]
    running = start(config, model_state, "admin-token-for-dashboards")
    try:
        wait_ready(running, 2)
        started = time.monotonic()
        _wait_for_replica_series(Observed(running, f"http://127.0.0.1:{port}", 0.0),
                                 len(fleet_replicas(Observed(running, "", 0.0))))
        print(f"every replica in Prometheus {time.monotonic() - started:.1f}s after the fleet was ready")
        since = time.time()
        stop, answered = threading.Event(), list[int]()
        clients = [threading.Thread(target=_load, args=(running.gateway, stop, answered), daemon=True)
                   for _ in range(CLIENTS)]
        for t in clients:
            t.start()
        try:
            wait_until(lambda: len(answered) >= LOAD_REQUESTS, timeout=LOAD_TIMEOUT_S,
                       what=f"{LOAD_REQUESTS} requests answered through the gateway")
        finally:
            stop.set()
        for t in clients:
            t.join(60)
        assert answered and set(answered) == {200}, answered
        yield Observed(running, f"http://127.0.0.1:{port}", since)
    finally:
        shutdown(running)


def fleet_replicas(observed: Observed) -> dict[str, str]:
    with observed.running.client() as client:
        return {r.replica_id: r.zone for r in client.fleet().replicas}


def _wait_for_replica_series(observed: Observed, replicas: int) -> None:
    """Every replica's series in Prometheus (its first scrapes may come after the load on a busy machine);
    on time-out, what Prometheus says of its targets."""
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        running = _get(observed, "/api/v1/query", query="vllm:num_requests_running")["result"]
        if len({s["metric"].get("replica") for s in running}) >= replicas:
            return
        if time.monotonic() > deadline:
            targets = _get(observed, "/api/v1/targets")["activeTargets"]
            raise AssertionError(f"{len(running)} of {replicas} replicas' series after {DATA_TIMEOUT_S:g}s; "
                                 "targets: " + "; ".join(f"{t['labels'].get('job')} {t['scrapeUrl']} "
                                                         f"{t['health']} {t['lastError']}" for t in targets))
        time.sleep(1.0)


def _get(observed: Observed, path: str, **params: Any) -> Any:
    response = httpx.get(f"{observed.prometheus}{path}", params=params, timeout=10, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()["data"]


def _has_data(observed: Observed, expr: str) -> bool:
    """Whether the range query from the load's start to now has at least one number (NaN is no data)."""
    result = _get(observed, "/api/v1/query_range", query=expr, start=observed.since, end=time.time(),
                  step=STEP_S)["result"]
    return any(not math.isnan(float(v)) for series in result for _, v in series["values"])


def _label_values(observed: Observed, label: str, match: str) -> list[str]:
    return list(_get(observed, f"/api/v1/label/{label}/values", **{"match[]": match}))


def _fill(expr: str, variables: dict[str, str]) -> str:
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):  # $__rate_interval first
        expr = expr.replace(f"${name}", value)
    return expr


def _empty_queries(observed: Observed, panels: list[tuple[str, list[str]]],
                   variables: dict[str, str]) -> list[str]:
    return [f"{title}: {expr}" for title, exprs in panels for expr in (_fill(e, variables) for e in exprs)
            if not _has_data(observed, expr)]


def _until_all_have_data(observed: Observed, panels: list[tuple[str, list[str]]],
                         variables: dict[str, str]) -> list[str]:
    """The queries still empty once every one had data, or ``DATA_TIMEOUT_S`` passed."""
    empty: list[str] = []

    def settled() -> bool:
        empty[:] = _empty_queries(observed, panels, variables)
        return not empty

    with contextlib.suppress(AssertionError):  # the caller asserts on what is still empty
        wait_until(settled, timeout=DATA_TIMEOUT_S, interval=1.0, what="every panel to show data")
    return empty


def _model_name(observed: Observed) -> str:
    # The dashboards' variable query, label_values({__name__=~"vllm:.*"}, model_name), as Grafana runs it
    models = _label_values(observed, "model_name", '{__name__=~"vllm:.*"}')
    assert models == ["default"]
    return models[0]


def test_every_panel_of_our_dashboard_returns_data_from_the_real_prometheus(observed: Observed) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    model = _model_name(observed)
    variables = {"model_name": model, "zone": ".*", "replica": ".*", "__rate_interval": RATE_INTERVAL}
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":  # each variable's own query lists values, as its drop-down would
            label = var["query"]["query"].rsplit(",", 1)[1].strip(" )")
            selector = _fill(var["query"]["query"].removeprefix("label_values(").rsplit(",", 1)[0], variables)
            assert _label_values(observed, label, selector), var["name"]
    panels = [(p["title"], [t["expr"] for t in p["targets"]])
              for p in dashboard["panels"] if p["type"] != "row"]

    assert _until_all_have_data(observed, panels, variables) == []


def test_every_panel_of_vllms_example_dashboard_shows_our_replicas(observed: Observed) -> None:
    reference = json.loads(VLLM_PANELS.read_text())
    variables = {"model_name": _model_name(observed), "__rate_interval": RATE_INTERVAL}
    panels = [(p["title"], p["exprs"]) for p in [*reference["current"], *reference["earlier"]["panels"]]]

    assert _until_all_have_data(observed, panels, variables) == []


def test_each_replica_series_carries_the_fleets_identity_once(observed: Observed) -> None:
    fleet = fleet_replicas(observed)
    running = _get(observed, "/api/v1/query", query="vllm:num_requests_running")["result"]

    assert {s["metric"]["replica"]: s["metric"]["zone"] for s in running} == fleet
    echoed = _get(observed, "/api/v1/query", query='{job="replicas",exported_replica!=""}')["result"]
    assert echoed == []
    assert all("exported_zone" not in s["metric"] for s in running)
