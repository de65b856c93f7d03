"""A drill report for people (Markdown): an unmeasured figure reads "not measured", and the report says
how long the drill waited for its steady state and why its load did not start."""

from __future__ import annotations

from controlplane.drills.report import to_markdown


def test_the_verdict_shows_a_figure_that_was_not_measured_as_such() -> None:
    report = {"id": 7, "scenario": "replica-crash", "status": "failed", "figures": {"rto_service_s": None},
              "checks": [{"name": "rto_service_s", "target": 1.0, "measured": None, "ok": False,
                          "outcome": "not measured"},
                         {"name": "requests_failed", "target": 0, "measured": 2, "ok": False,
                          "outcome": "fail"},
                         {"name": "tokens_lost", "target": 0, "measured": 0, "ok": True}]}
    lines = to_markdown(report).splitlines()
    assert "| rto_service_s | <= 1.000 | not measured | NOT MEASURED |" in lines
    assert "| requests_failed | <= 0 | 2 | FAIL |" in lines
    assert "| tokens_lost | <= 0 | 0 | pass |" in lines  # a report stored before outcomes were kept


def test_the_report_says_what_the_drill_waited_for_and_why_its_load_did_not_start() -> None:
    report = {"id": 8, "scenario": "zone-outage", "status": "error",
              "error": "LoadNotFlowing: the load never reached the gateway: ...",
              "steady_state": {"ok": True, "waited_s": 14.5, "timeout_s": 180.0,
                               "waited_for": ["fleet: 0 of 3 replicas ready",
                                              "gateway probe: the gateway lists no model"]},
              "load": {"not_started": "the load client (pid 9) was still starting after 60 s"}}
    text = to_markdown(report)
    assert ("- steady state reached after 14.500 s (at most 180.000 s); waited for: fleet: 0 of 3 replicas "
            "ready; gateway probe: the gateway lists no model") in text
    assert "- load not started: the load client (pid 9) was still starting after 60 s" in text
