"""The Chaos page's slice-experiment section from fixture answers of ``/api/v1/experiments/slices``
(decoded as the typed client decodes them), and its actions against a fake client: what an operator reads
of a run's checks, its stop and both sides' figures, and the notes a refused action leaves."""

from __future__ import annotations

import json
from typing import Any

import pytest
from dash import html
from plotly.utils import PlotlyJSONEncoder

from controlplane.client import ApiError, SliceExperiment, SliceExperimentSummary
from controlplane.views.decoder import decode, decode_list
from dashboards import slice_figures as sf

T0 = 1_767_000_000.0
SPEC = {"share": 0.1, "fault": "error_rate", "params": {"probability": 0.3}, "duration_s": 60.0,
        "check_interval_s": 1.0, "colour": "chaos", "control": "control",
        "bounds": {"max_error_increase": 0.05, "max_latency_ratio": 1.5, "alpha": 0.01, "min_samples": 10}}


def counts(requests: int, failed: int) -> dict[str, int]:
    return {"requests": requests, "failed": failed}


def check(t: float, exp: tuple[int, int], ctl: tuple[int, int], verdict: str,
          uncoloured: tuple[int, int] = (80, 0)) -> dict[str, Any]:
    return {"t": t, "verdict": verdict, "reasons": ["errors: 9 of 30 failed against 0 of 31"]
            if verdict == "fail" else [], "experiment": counts(*exp), "control": counts(*ctl),
            "uncoloured": counts(*uncoloured)}


def figures(requests: int, failed: int, p50: float | None = None, p95: float | None = None,
            p99: float | None = None) -> dict[str, Any]:
    return {"requests": requests, "failed": failed, "error_rate": round(failed / requests, 5),
            "p50": p50, "p95": p95, "p99": p99}


CHECKS = [check(1.0, (10, 2), (11, 0), "inconclusive"), check(2.0, (20, 6), (21, 0), "inconclusive"),
          check(3.01, (30, 9), (31, 0), "fail")]
REPORT = {
    "experiment": {"requests": 30, "failed": 9, "metrics": {
        "errors": figures(30, 9), "ttft": figures(21, 0, 41.0, 60.5, 70.2),
        "tpot": figures(21, 0, 9.0, 11, 12)}},
    "control": {"requests": 31, "failed": 0, "metrics": {
        "errors": figures(31, 0), "ttft": figures(31, 0, 40.0, 58.0, 66.0),
        "tpot": figures(31, 0, 9.1, 11, 12)}},
    "uncoloured": counts(240, 0),
    "analysis": {"verdict": "fail", "reasons": ["errors: 30.0% against 0.0%"], "metrics": []},
    "differences": [
        {"metric": "error_rate", "estimate": 0.3, "low": 0.148, "high": 0.478, "confidence": 0.95,
         "method": "newcombe-wilson", "excludes_zero": True},
        {"metric": "ttft_p50_s", "estimate": 0.001, "low": -0.004, "high": 0.0062, "confidence": 0.95,
         "method": "bootstrap (2000 resamples)", "excludes_zero": False},
    ],
}
DEVIATED = {"id": 4, "status": "deviated", "by": "admin", "spec": SPEC, "started_at": T0,
            "coloured_at": T0 + 0.5, "finished_at": T0 + 3.6, "fault_ids": [7, 8, 9],
            "fault_targets": ["az-a-1", "az-b-1", "az-c-1"], "checks": CHECKS, "report": REPORT,
            "stopped": {"reason": "deviation", "detail": "errors: 30.0% against 0.0%", "after_s": 3.05},
            "faults_reverted": True, "colours_cleared": True,
            "reverts": [{"fault_id": i, "ok": True, "detail": ""} for i in (7, 8, 9)]}
RUNNING = {"id": 5, "status": "running", "by": "admin", "spec": {**SPEC, "fault": "token_latency",
                                                                  "params": {"seconds": 0.05}},
           "started_at": T0 + 100, "coloured_at": T0 + 100.5, "finished_at": None,
           "checks": CHECKS[:2], "report": None, "stopped": None}
LISTING = [
    {"id": 5, "status": "running", "by": "admin", "fault": "token_latency", "share": 0.1,
     "started_at": T0 + 100, "experiment": counts(20, 6), "control": counts(21, 0),
     "uncoloured": counts(80, 0)},
    {"id": 4, "status": "deviated", "by": "admin", "fault": "error_rate", "share": 0.1, "started_at": T0,
     "finished_at": T0 + 3.6, "stopped": DEVIATED["stopped"], "experiment": counts(30, 9),
     "control": counts(31, 0), "uncoloured": counts(240, 0)},
    {"id": 3, "status": "completed", "by": "ops", "fault": "prefill_delay", "share": 0.05,
     "started_at": T0 - 900, "finished_at": T0 - 840,
     "stopped": {"reason": "duration", "detail": "no deviation beyond the bounds in 60 s", "after_s": 60.0},
     "experiment": counts(300, 0), "control": counts(301, 0), "uncoloured": counts(2400, 0)},
]


def text(component: Any) -> str:
    """Every string inside a Dash component tree, joined."""
    if isinstance(component, str | int | float):
        return str(component)
    if isinstance(component, list | tuple):
        return " ".join(text(c) for c in component)
    children = getattr(component, "children", None)
    return "" if children is None else text(children)


def cells(row: html.Tr) -> list[str]:
    return [text(c) for c in row.children]


def experiment(raw: dict[str, Any]) -> SliceExperiment:
    return decode(SliceExperiment, raw)


# ---- the builders --------------------------------------------------------------------------------
def test_the_form_becomes_the_start_request_in_shares() -> None:
    assert sf.start_request(10, "error_rate", 0.3, 60, 1, 5, 1.5) == {
        "share": 0.1, "fault": "error_rate", "params": {"probability": 0.3}, "duration_s": 60.0,
        "check_interval_s": 1.0, "bounds": {"max_error_increase": 0.05, "max_latency_ratio": 1.5}}
    latency = sf.start_request("2.5", "prefill_delay", 0.2, 30, 0.5, None, "")
    assert latency["params"] == {"seconds": 0.2} and latency["share"] == 0.025 and "bounds" not in latency
    for args, message in (((10, "hang", 1, 60, 1, 5, 1.5), "choose a fault"),
                          ((60, "error_rate", 0.3, 60, 1, 5, 1.5), "share"),
                          ((10, "error_rate", None, 60, 1, 5, 1.5), "probability: give a number"),
                          ((10, "token_latency", "x", 60, 1, 5, 1.5), "seconds: 'x' is not a number")):
        with pytest.raises(ValueError, match=message):
            sf.start_request(*args)


def test_the_running_one_is_shown_else_the_latest() -> None:
    listing = decode_list(SliceExperimentSummary, LISTING)
    assert sf.shown_id(listing) == 5
    assert sf.shown_id(listing[1:]) == 4
    assert sf.shown_id([]) is None


def test_a_deviated_run_says_why_and_when_it_stopped() -> None:
    body = sf.summary(experiment(DEVIATED))
    assert body.id == "sx-body" and body.to_plotly_json()["props"]["data-status"] == "deviated"
    said = text(body)
    assert ("Slice experiment 4: error_rate (probability 0.3) on 10% (chaos) against 10% (control): "
            "deviated") in said
    assert "stopped: deviation" in said and "time to stop: 3.0 s" in said  # 3.05 s
    assert "errors: 30.0% against 0.0%" in said and "faults reverted: yes · colours cleared: yes" in said
    running = text(sf.summary(experiment(RUNNING), now=T0 + 112.5))
    assert "token_latency (seconds 0.05)" in running and "running for 12 s: 2 check(s)" in running
    assert sf.summary(None).id == "sx-none"


def test_the_checks_figure_draws_each_side_and_marks_the_stop() -> None:
    fig = sf.checks_figure(experiment(DEVIATED))
    traces = {t.name: t for t in fig.data}
    assert list(traces["experiment (chaos) failures %"].y) == [20.0, 30.0, 30.0]
    assert list(traces["control (control) failures %"].y) == [0.0, 0.0, 0.0]
    assert list(traces["experiment requests"].y) == [10, 20, 30]
    assert list(traces["control requests"].x) == [1.0, 2.0, 3.01]
    assert traces["experiment (chaos) failures %"].marker.color[-1] == sf.VERDICT_COLOURS["fail"]
    [stop] = fig.layout.shapes
    assert stop.x0 == 3.05 and "stop: deviation" in fig.layout.annotations[0].text
    assert not sf.checks_figure(experiment(RUNNING)).layout.shapes  # no stop yet
    assert "no slice experiment yet" in sf.checks_figure(None).layout.annotations[0].text
    starting = sf.checks_figure(experiment({**RUNNING, "checks": []}))
    assert "no check yet" in starting.layout.annotations[0].text


def test_the_sides_table_has_both_sides_each_difference_and_the_uncoloured() -> None:
    rows = sf.sides_rows(experiment(DEVIATED))
    assert cells(rows[1]) == ["errors", "experiment (chaos)", "30", "9", "30.00%", "–", "–", "–",
                              "+30.00 pp", "[+14.80, +47.80] pp", "yes: excludes 0"]
    assert cells(rows[2]) == ["control (control)", "31", "0", "0.00%", "–", "–", "–"]
    assert cells(rows[3]) == ["ttft", "experiment (chaos)", "21", "0", "0.00%", "41.0", "60.5", "70.2",
                              "+1.0 ms", "[-4.00, +6.20] ms", "no: includes 0"]
    assert cells(rows[5])[0] == "tpot" and cells(rows[5])[-3:] == ["–", "–", "–"]  # no interval for it
    uncoloured = rows[-1]
    assert uncoloured.id == "sx-uncoloured"
    assert cells(uncoloured)[:4] == ["uncoloured", "neither colour", "240", "0"]
    assert "must be 0" in text(uncoloured) and "FAILED" not in text(uncoloured)
    leaked = sf.sides_rows(experiment({**DEVIATED, "report": {**REPORT, "uncoloured": counts(240, 2)}}))
    assert "2 FAILED" in text(leaked[-1]) and leaked[-1].children[3].className == "outcome-error"


def test_while_it_runs_the_table_has_the_latest_check_counts() -> None:
    rows = sf.sides_rows(experiment(RUNNING))
    assert cells(rows[1])[:5] == ["errors (so far)", "experiment (chaos)", "20", "6", "30.00%"]
    assert "with the report, at the end" in text(rows[1])
    assert cells(rows[3])[:4] == ["uncoloured", "neither colour", "80", "0"]
    assert sf.sides_rows(None)[-1].id == "sx-no-sides"
    assert sf.sides_rows(experiment({**RUNNING, "checks": []}))[-1].id == "sx-no-sides"


def test_the_history_lists_each_run_with_its_stop_and_counts() -> None:
    rows = sf.history_rows(decode_list(SliceExperimentSummary, LISTING))
    assert [cells(r)[1] for r in rows[1:]] == ["running", "deviated", "completed"]
    assert cells(rows[2])[6:] == ["deviation", "3.0 s", "30 / 9", "31 / 0", "240 / 0"]
    assert cells(rows[3])[3] == "5%" and cells(rows[1])[6:8] == ["–", "–"]
    assert sf.history_rows([])[-1].id == "sx-no-history"


# ---- the actions and the live view ---------------------------------------------------------------
class FakeApi:
    """The typed client as the section uses it: answers the fixtures, records the calls, or refuses."""

    def __init__(self, listing: list[dict[str, Any]], refuse: ApiError | None = None) -> None:
        self.listing, self.refuse = listing, refuse
        self.calls: list[tuple[Any, ...]] = []

    def _maybe_refuse(self) -> None:
        if self.refuse:
            raise self.refuse

    def slice_experiments(self, limit: int = 50) -> list[SliceExperimentSummary]:
        self._maybe_refuse()
        return decode_list(SliceExperimentSummary, self.listing[:limit])

    def slice_experiment(self, experiment_id: int) -> SliceExperiment:
        self.calls.append(("get", experiment_id))
        return experiment({5: RUNNING, 4: DEVIATED}[experiment_id])

    def slice_experiment_start(self, **request: Any) -> Any:
        self.calls.append(("start", request))
        self._maybe_refuse()
        from controlplane.client import SliceExperimentStarted

        return decode(SliceExperimentStarted, {"id": 6, "status": "running"})

    def slice_experiment_abort(self, experiment_id: int) -> Any:
        self.calls.append(("abort", experiment_id))
        self._maybe_refuse()
        from controlplane.client import SliceExperimentAbort

        return decode(SliceExperimentAbort, {"id": experiment_id, "aborting": True})


@pytest.fixture(scope="module")
def panel() -> Any:
    from dashboards.app import ConsoleConfig, create_console

    create_console("http://127.0.0.1:1", ConsoleConfig(secret="s" * 32))  # registers the pages
    from dashboards import slice_panel

    return slice_panel


def test_start_and_abort_send_the_form_and_show_a_refusal_as_a_note(panel: Any) -> None:
    api = FakeApi(LISTING)
    done = panel.start_experiment(api, 10, "error_rate", 0.3, 60, 1, 5, 1.5)
    assert done.id == "sx-started" and "slice experiment 6 started" in text(done)
    assert api.calls[-1] == ("start", sf.start_request(10, "error_rate", 0.3, 60, 1, 5, 1.5))
    bad = panel.start_experiment(api, 90, "error_rate", 0.3, 60, 1, 5, 1.5)
    assert bad.id == "sx-start-refused" and bad.className == "notice" and len(api.calls) == 1
    busy = FakeApi(LISTING, ApiError("slice experiment 5 is running; one at a time", status=409))
    note = panel.start_experiment(busy, 10, "error_rate", 0.3, 60, 1, 5, 1.5)
    assert text(note) == "start refused: slice experiment 5 is running; one at a time"
    assert "Traceback" not in text(note)

    aborted = panel.abort_experiment(api, 5)
    assert api.calls[-1] == ("abort", 5) and aborted.id == "sx-aborted" and "aborting" in text(aborted)
    refused = panel.abort_experiment(FakeApi(LISTING, ApiError("slice experiment 4 is not running",
                                                                status=409)), 4)
    assert refused.id == "sx-abort-refused"
    assert "abort refused: slice experiment 4 is not running" in text(refused)
    assert panel.abort_experiment(api, None).id == "sx-abort-refused"


def test_the_live_view_follows_the_run_and_the_role(panel: Any) -> None:
    import dash

    api = FakeApi(LISTING)
    body, fig, sides, history, shown, drawn, abort_off, start_off = panel.show(api, True, None, now=T0 + 110)
    assert shown == 5 and drawn == [5, "running", 2] and api.calls == [("get", 5)]
    assert "running for 10 s" in text(body) and len(fig.data) == 4 and len(sides) == 4
    assert [r.to_plotly_json()["props"]["data-experiment"] for r in history[1:]] == ["5", "4", "3"]
    assert (abort_off, start_off) == (False, True)  # abort the running one; one at a time
    assert panel.show(api, False, None)[-2:] == (True, True)  # a viewer
    ended = panel.show(FakeApi(LISTING[1:]), True, None)
    assert ended[-2:] == (True, False) and ended[5] == [4, "deviated", 3]
    assert "time to stop" in json.dumps(ended, cls=PlotlyJSONEncoder)  # what Dash sends the browser
    assert panel.show(FakeApi(LISTING[1:]), True, [4, "deviated", 3])[1] is dash.no_update  # keeps the zoom
    empty = panel.show(FakeApi([]), True, None)
    assert empty[0].id == "sx-none" and empty[4] is None and empty[-2:] == (True, False)
    down = panel.show(FakeApi(LISTING, ApiError("control plane unreachable", status=503)), True, None)
    assert down[0].id == "sx-read-error" and "control plane unreachable" in text(down[0])
    assert down[-2:] == (True, False)


def test_the_fault_parameter_follows_the_fault(panel: Any) -> None:
    assert panel.fault_param("error_rate") == (sf.FAULTS["error_rate"][1], 0.2)
    assert panel.fault_param("prefill_delay")[0] == "Extra seconds before the first token"
    assert panel.fault_param(None)[1] == 0.2
