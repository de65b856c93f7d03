"""The Overview's expert-load panel, rendered from fixture answers of ``GET /api/v1/metrics/experts``: a
mixture-of-experts fleet gets a heatmap (replicas x experts, tokens/s) whose rows name each replica's
imbalance; a dense fleet gets a plain sentence saying the model has no experts (no empty chart, no error).
The console test checks the dense sentence in a real browser against a real fleet."""

from __future__ import annotations

from typing import Any

import pytest
from dash import dcc

from controlplane.client import ApiError, ExpertLoad, ReplicaExpertLoad
from dashboards.app import ConsoleConfig, create_console
from dashboards.figures import expert_heatmap, ratio

MOE = ExpertLoad(scope="fleet", window_s=30.0, experts=("0", "1", "2", "3"), replicas=(
    ReplicaExpertLoad("az-b-1", (20.0, 20.0, 20.0, 20.0), (600.0, 600.0, 600.0, 600.0), 1.0, 1.0),
    ReplicaExpertLoad("az-a-1", (40.0, 20.0, 20.0, None), (1200.0, 600.0, 600.0, None), 2.0, 1.5),
))
DENSE = ExpertLoad(scope="fleet", window_s=30.0, experts=(), replicas=())


def overview() -> Any:
    create_console("http://127.0.0.1:1", ConsoleConfig(secret="s" * 32))  # registers the pages
    from dashboards.pages import overview

    return overview


def walk(component: Any) -> list[Any]:
    """Every component of a Dash tree."""
    children = getattr(component, "children", None)
    kids = children if isinstance(children, list | tuple) else [children] if children is not None else []
    return [component, *(c for kid in kids for c in walk(kid))]


def text(component: Any) -> str:
    return " ".join(c for c in walk(component) if isinstance(c, str))


def test_the_heatmap_has_a_row_per_replica_and_a_column_per_expert() -> None:
    fig = expert_heatmap(MOE)
    (heatmap,) = fig.data
    assert heatmap.type == "heatmap"
    assert list(heatmap.x) == ["E0", "E1", "E2", "E3"]
    assert list(heatmap.y) == ["az-a-1 · imbalance 2.00×", "az-b-1 · imbalance 1.00×"]  # sorted
    assert [list(row) for row in heatmap.z] == [[40.0, 20.0, 20.0, None], [20.0, 20.0, 20.0, 20.0]]
    assert heatmap.customdata[0][0] == ["az-a-1", "1,200", "2.00×", "1.50×"]  # hover: totals, imbalances
    assert "tokens/s per expert (last 30 s)" in fig.layout.title.text
    assert "worst imbalance 2.00× on az-a-1" in fig.layout.title.text


def test_an_imbalance_reads_as_a_ratio_and_nothing_yet_as_a_dash() -> None:
    assert (ratio(1.4249), ratio(0.0), ratio(None)) == ("1.42×", "–", "–")


def test_a_moe_fleet_gets_the_heatmap_on_the_overview() -> None:
    panel = overview().expert_panel(MOE)
    graphs = [c for c in walk(panel) if isinstance(c, dcc.Graph)]
    (graph,) = [g.to_plotly_json()["props"] for g in graphs]
    assert graph["id"] == "ov-experts-heatmap" and graph["figure"].data[0].type == "heatmap"
    assert panel.to_plotly_json()["props"]["data-moe"] == "yes"


def test_a_dense_fleet_is_told_plainly_that_the_model_has_no_experts() -> None:
    panel = overview().expert_panel(DENSE)
    assert not [c for c in walk(panel) if isinstance(c, dcc.Graph)]  # no empty chart
    assert "the model has no experts" in text(panel)
    assert panel.to_plotly_json()["props"]["data-moe"] == "no"


def test_an_unanswered_query_says_so_without_claiming_the_model_is_dense() -> None:
    panel = overview().expert_panel(None, "expert load: HTTP 503: telemetry is not running")
    assert "telemetry is not running" in text(panel) and "no experts" not in text(panel)
    assert panel.to_plotly_json()["props"]["data-moe"] == "unknown"


class FakeClient:
    def __init__(self, answer: ExpertLoad | ApiError) -> None:
        self.answer = answer

    def expert_load(self) -> ExpertLoad:
        if isinstance(self.answer, ApiError):
            raise self.answer
        return self.answer


def test_each_refresh_asks_the_control_plane_and_renders_its_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    page = overview()
    monkeypatch.setattr(page.session, "client", lambda: FakeClient(MOE))
    assert page.refresh_experts(1).to_plotly_json()["props"]["data-moe"] == "yes"
    monkeypatch.setattr(page.session, "client", lambda: FakeClient(ApiError("HTTP 503: no Prometheus")))
    assert "expert load: HTTP 503: no Prometheus" in text(page.refresh_experts(2))
