"""The banner's alert lines say which rule fires, how bad, where and why, from the alerts API's records."""

from __future__ import annotations

from controlplane.client import ActiveAlert, ApiError, FleetView
from controlplane.views import NodeView
from dashboards.session import Outage
from dashboards.shell import _lost_nodes, alert_line, outage_banner


def test_a_firing_alert_reads_as_one_line() -> None:
    alert = ActiveAlert(key="HighErrorRate{replica=az-a-1}", rule="HighErrorRate", state="firing", since=0.0,
                        labels={"severity": "critical", "replica": "az-a-1", "alertname": "HighErrorRate"},
                        annotations={"summary": "5xx share above 5%"}, value=0.1234)
    expected = "ALERT HighErrorRate [critical] replica=az-a-1: 5xx share above 5% (value 0.123)"
    assert alert_line(alert) == expected


def test_an_alert_without_details_still_names_its_rule() -> None:
    alert = ActiveAlert(key="ReplicaDown", rule="ReplicaDown", state="firing", since=0.0)
    assert alert_line(alert) == "ALERT ReplicaDown"


class _Fleet:
    """The typed client as the banner reads it: the fleet's nodes and zones (a Ray fleet's)."""

    def __init__(self, fleet: FleetView) -> None:
        self._fleet = fleet

    def fleet(self) -> FleetView:
        return self._fleet


def test_a_lost_cluster_node_and_a_zone_without_nodes_are_named() -> None:
    fleet = FleetView(desired_replicas=3, ready_replicas=2, model="default", generation=0,
                      zones=("az-a", "az-b", "az-c"), replicas=(), rollout=None,
                      nodes=(NodeView("n1", "10.199.0.3", "az-a", True),
                             NodeView("n2", "10.199.0.4", "az-b", False)),
                      zones_down=("az-b",))
    lines = _lost_nodes(_Fleet(fleet))  # type: ignore[arg-type]
    assert lines == ["NODE 10.199.0.4 (az-b) LOST", "ZONE az-b: no node left"]
    local = FleetView(desired_replicas=3, ready_replicas=3, model="default", generation=0, zones=("az-a",),
                      rollout=None,
                      replicas=())
    assert _lost_nodes(_Fleet(local)) == []  # type: ignore[arg-type]


def test_the_outage_banner_says_since_when_and_what_the_pages_show() -> None:
    now = [1_000_000.0]
    outage = Outage(clock=lambda: now[0])
    outage.answered()
    now[0] += 30
    with outage.reporting():
        outage.unreachable(ApiError("cannot reach the control plane at http://127.0.0.1:8080: refused"))
    now[0] += 12
    text = " ".join(str(part.children) for part in outage_banner(outage))
    assert "unreachable for 12 s" in text and "what it last answered at" in text
    assert "keep serving" in text and "refused" in text
    outage.answered()
    assert outage.since is None
