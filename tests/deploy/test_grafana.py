"""``deploy/grafana/``, checked without Grafana: the dashboard is valid and names only series that exist,
the recording rules file is what the control plane loads into its own Prometheus and promtool accepts it.

That every panel returns data from a live fleet is ``tests/controlplane/up/test_dashboards.py``; here,
each metric a query names must be exported by a replica (vLLM's list, ``tests/replica/data/``), a gateway
or the control plane, or recorded by the rules, so that a panel that reads 0 by design (``or vector(0)``,
for events that did not happen) cannot hide a misspelt name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from controlplane.api.state_metrics import ControlPlaneState, StateSources
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.telemetry.recording_rules import rule_file, rules
from inference.metrics import CacheConfigInfo, EngineGauges, ReplicaMetrics
from inference.runtime_metrics import ASYNCIO_TASKS

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "llmsre-fleet.json"
RULES = GRAFANA / "recording-rules.yml"
VLLM_LIST = ROOT / "tests" / "replica" / "data" / "vllm_metrics.json"
NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
PROMQL_WORDS = {"sum", "rate", "increase", "histogram_quantile", "or", "on", "vector"}
# Grafana's variables as a panel's query uses them, filled in for promtool
VARIABLES = {"$__rate_interval": "1m", "$model_name": "m", "$zone": ".*", "$replica": ".*"}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] if p["type"] != "row"
            for t in p["targets"]]


class _Fleet:
    desired_total = 2

    def num_ready(self) -> int:
        return 2


class _Autoscaler:
    def __init__(self) -> None:
        self.ticks = 1
        self.last: dict[str, Any] | None = {"recommendation": 2, "final": 2}
        self.mode = "observe_only"


def _sample_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry can put on a page, including labelled ones not yet created."""
    names = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def exported_names() -> set[str]:
    vllm = json.loads(VLLM_LIST.read_text())["metrics"]
    names = {name + suffix for name, spec in vllm.items() for suffix in SUFFIXES[spec["type"]]}
    replica = ReplicaMetrics(model_name="m", replica="r", zone="z", max_model_len=64,
                             read_engine=lambda: EngineGauges(0, 0, 0.0, 0, 0, 0, 1, 2, 0.5),
                             cache_info=CacheConfigInfo(16, 8, "auto", True))
    # a mixture-of-experts replica adds its expert load (a dense one exports none of it)
    moe = ReplicaMetrics(model_name="m", replica="r", zone="z", max_model_len=64,
                         read_engine=lambda: EngineGauges(0, 0, 0.0, 0, 0, 0, 1, 2, 0.5,
                                                          expert_tokens=[[1, 2], [3, 4]]),
                         cache_info=CacheConfigInfo(16, 8, "auto", True))
    names |= _sample_names(moe.registry)
    control = CollectorRegistry()
    control.register(ControlPlaneState(StateSources(_Fleet(), _Autoscaler(), None, lambda: 0)))
    names |= _sample_names(replica.registry) | _sample_names(GatewayMetrics().registry)
    names |= _sample_names(control) | {rule.record for rule in rules()} | {"up"}
    names.add("llmsre_drill_running")  # exported when the control plane runs drills (always under `up`)
    names.add(ASYNCIO_TASKS)  # collected on a running event loop only
    return names


def test_dashboard_is_a_grafana_dashboard_with_a_query_in_every_panel() -> None:
    d = dashboard()
    assert d["uid"] == "llmsre-fleet" and d["schemaVersion"] >= 39
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len(panels) >= 20
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Fleet", "Replicas", "Gateway", "Autoscaler", "Drills and faults"]
    variables = {v["name"] for v in d["templating"]["list"]}
    assert variables == {"DS_PROMETHEUS", "model_name", "zone", "replica"}


def test_every_metric_a_panel_names_is_exported_or_recorded() -> None:
    known = exported_names()

    unknown = []
    for title, expr in queries():
        # metric names only: no label matchers, ranges, grouping labels or numbers
        bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\bby\s*\([^)]*\)|(?<![\w:])[0-9.]+", " ", expr)
        unknown += [f"{title}: {word}" for word in NAME.findall(bare)
                    if word not in PROMQL_WORDS and word not in known]
    assert unknown == []


def test_recording_rules_file_is_what_the_control_plane_loads() -> None:
    assert RULES.read_text() == rule_file(), "regenerate: python -m controlplane.telemetry.recording_rules"


def test_every_recorded_series_the_dashboard_reads_is_recorded() -> None:
    recorded = {rule.record for rule in rules()}
    read = {word for _, expr in queries() for word in NAME.findall(expr) if ":quantile_rate" in word}
    assert read and read <= recorded


def test_promtool_accepts_the_recording_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        reason = "unavailable: promtool binary not found"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_the_expert_load_panel_charts_each_experts_token_rate_and_is_valid_promql(tmp_path: Path) -> None:
    (panel,) = [p for p in dashboard()["panels"] if p["title"].startswith("Expert load")]
    (target,) = panel["targets"]
    expr = target["expr"]
    assert expr.startswith("sum by (expert) (rate(llmsre_moe_expert_tokens_total{")
    assert 'replica=~"$replica"' in expr and "[$__rate_interval]" in expr
    assert expr.endswith("or on() vector(0)")  # a dense model's flat 0, not "no data"; MoE: no extra line
    assert target["legendFormat"] == "expert {{expert}}"
    assert panel["gridPos"]["w"] == 24 and rows_above(panel)[-1] == "Replicas"
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("unavailable: promtool binary not found")
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    rules = tmp_path / "expert-load.yml"
    rules.write_text(json.dumps({"groups": [{"name": "g", "rules": [{"record": "panel:expert_load",
                                                                      "expr": expr}]}]}))
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def rows_above(panel: dict[str, Any]) -> list[str]:
    """The titles of the rows above ``panel`` on the grid, nearest last."""
    return [p["title"] for p in dashboard()["panels"]
            if p["type"] == "row" and p["gridPos"]["y"] < panel["gridPos"]["y"]]
