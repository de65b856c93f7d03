"""The banner's alert lines say which rule fires, how bad, where and why, from the alerts API's records."""

from __future__ import annotations

from dashboards.shell import alert_line


def test_a_firing_alert_reads_as_one_line() -> None:
    alert = {"key": "HighErrorRate{replica=az-a-1}", "rule": "HighErrorRate", "state": "firing",
             "labels": {"severity": "critical", "replica": "az-a-1", "alertname": "HighErrorRate"},
             "annotations": {"summary": "5xx share above 5%"}, "value": 0.1234}
    expected = "ALERT HighErrorRate [critical] replica=az-a-1: 5xx share above 5% (value 0.123)"
    assert alert_line(alert) == expected


def test_an_alert_without_details_still_names_its_rule() -> None:
    assert alert_line({"rule": "ReplicaDown", "labels": {}, "state": "firing", "value": None}) == \
        "ALERT ReplicaDown"
