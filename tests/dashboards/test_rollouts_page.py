"""The Rollouts page's figures and tables from fixture answers of ``/api/v1/versions`` and
``/api/v1/rollouts`` (decoded as the typed client decodes them), and its actions against a fake client: what
an operator reads of a canary's split, steps and analyses, and the notes a refused action leaves."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.client import ApiError, ReleaseView, RolloutsView, VersionsView
from controlplane.views.decoder import decode
from dashboards import rollout_figures as rf

T0 = 1_767_000_000.0


def side(requests: int, failed: int, p50: float | None = None, p95: float | None = None,
         p99: float | None = None) -> dict[str, Any]:
    rate = round(failed / requests, 5) if requests else 0
    return {"requests": requests, "failed": failed, "error_rate": rate,
            "p50": p50, "p95": p95, "p99": p99}


def analysis(share: float, start: float, decision: str, verdict: str, *,
             slower: bool = False) -> dict[str, Any]:
    ttft_ratio = 1.62 if slower else 1.01
    return {
        "event": "analysis", "share": share, "window": [start, start + 60], "decision": decision,
        "verdict": verdict,
        "reasons": ["ttft: median 81.0 ms against 50.0 ms (x1.62, p=1e-05)"] if verdict == "fail" else [],
        "metrics": [
            {"metric": "errors", "test": "fisher-exact (one-sided)", "baseline": side(400, 2),
             "candidate": side(30, 0), "p_value": 1.0, "difference": -0.005, "verdict": "pass",
             "reason": "no more failures than stable"},
            {"metric": "ttft", "test": "mann-whitney-u (one-sided)",
             "baseline": side(400, 2, 50.0, 80.0, 95.5),
             "candidate": side(30, 0, 50.0 * ttft_ratio, 120.0, 140.0),
             "p_value": 1e-05 if slower else 0.41, "difference": ttft_ratio,
             "verdict": "fail" if slower else "pass", "reason": "median 81.0 ms against 50.0 ms"},
            {"metric": "tpot", "test": "mann-whitney-u (one-sided)", "baseline": side(0, 0),
             "candidate": side(0, 0), "p_value": None, "difference": None, "verdict": "inconclusive",
             "reason": "0 streams on one side, fewer than 30"},
        ],
    }


POLICY = {"steps": [0.05, 0.2, 0.5, 1.0], "interval_s": 60.0, "max_extensions": 3, "replicas": 1,
          "warmup_s": 2.0, "thresholds": {"alpha": 0.01}}
RUNNING = {
    "id": 3, "version": "v3", "from_version": "v2", "kind": "canary", "started": T0, "outcome": "running",
    "ended": None, "reason": "",
    "steps": [
        {"event": "started", "at": T0, "policy": POLICY},
        {"event": "step", "share": 0.05, "at": T0 + 5},
        analysis(0.05, T0 + 7, "next", "pass"),
        {"event": "step", "share": 0.2, "at": T0 + 68},
        analysis(0.2, T0 + 68, "extend", "inconclusive"),
        {"event": "pause", "at": T0 + 130},
        {"event": "resume", "at": T0 + 150},
    ],
}
ABORTED = {
    "id": 2, "version": "v2-slow", "from_version": "v2", "kind": "canary", "started": T0 - 900,
    "outcome": "aborted", "ended": T0 - 830, "reason": "ttft: median 81.0 ms against 50.0 ms",
    "steps": [
        {"event": "started", "at": T0 - 900, "policy": POLICY},
        {"event": "step", "share": 0.05, "at": T0 - 895},
        analysis(0.05, T0 - 893, "abort", "fail", slower=True),
        {"event": "aborted", "at": T0 - 830, "reason": "ttft: median 81.0 ms against 50.0 ms"},
    ],
}
PROMOTED = {
    "id": 1, "version": "v2", "from_version": "v1", "kind": "canary", "started": T0 - 2000,
    "outcome": "promoted", "ended": T0 - 1700, "reason": "every step passed",
    "steps": [
        {"event": "started", "at": T0 - 2000, "policy": POLICY},
        {"event": "step", "share": 0.5, "at": T0 - 1995},
        analysis(0.5, T0 - 1993, "next", "pass"),
        {"event": "step", "share": 1.0, "at": T0 - 1930},
        analysis(1.0, T0 - 1930, "next", "pass"),
        {"event": "promoting", "at": T0 - 1870, "reason": "every step passed"},
    ],
}


def rollouts(release: dict[str, Any] | None, history: list[dict[str, Any]], *,
             split: dict[str, float] | None = None, colours: dict[str, float] | None = None) -> RolloutsView:
    raw = {"current": "v2", "plan": {"split": split or {}, "colours": colours or {}}, "release": release,
           "history": history}
    return decode(RolloutsView, raw)


def text(component: Any) -> str:
    """The text a browser would show for a Dash component tree."""
    children = getattr(component, "children", component)
    if isinstance(children, (list, tuple)):
        return " | ".join(text(c) for c in children)
    return str(children) if children is not None else ""


def test_the_split_shows_stable_against_the_canary_and_the_colours_of_an_experiment() -> None:
    view = rollouts(RUNNING, [RUNNING], split={"v3": 0.2}, colours={"blue": 0.1})
    assert rf.split_shares(view) == [("stable (v2)", pytest.approx(0.8)), ("v3", 0.2)]
    assert rf.colour_shares(view) == [("blue", 0.1), ("uncoloured", pytest.approx(0.9))]
    assert rf.split_line(view) == "stable (v2) 80.0% · v3 20.0% | colours: blue 10.0% · uncoloured 90.0%"
    bars = [(t.y[0], t.name, t.x[0]) for t in rf.split_figure(view).data]
    assert bars == [("versions", "stable (v2)", pytest.approx(80.0)), ("versions", "v3", 20.0),
                    ("colours", "blue", 10.0), ("colours", "uncoloured", pytest.approx(90.0))]
    quiet = rollouts(None, [])
    assert rf.split_line(quiet) == "stable (v2) 100.0%"
    assert [t.y[0] for t in rf.split_figure(quiet).data] == ["versions"]  # no colours row


def test_the_timeline_draws_the_share_and_marks_each_decision() -> None:
    release = decode(ReleaseView, RUNNING)
    fig = rf.release_timeline(release, now=T0 + 200)
    traces = {t.name: t for t in fig.data}
    share = traces["v3 share (%)"]
    assert list(share.y) == [0.0, 5.0, 20.0, 20.0]  # started, each step, then now
    assert share.x[-1] == "2025-12-29T09:23:20"  # now, in UTC
    assert len(traces["analysis: next step"].x) == 1 and list(traces["analysis: extend the step"].y) == [20.0]
    assert "analysis: abort" not in traces
    assert list(traces["paused"].y) == [20.0] and list(traces["resumed"].y) == [20.0]
    assert "20%: inconclusive -> extend" in traces["analysis: extend the step"].text[0]

    aborted = {t.name: t for t in rf.release_timeline(decode(ReleaseView, ABORTED)).data}
    assert list(aborted["v2-slow share (%)"].y) == [0.0, 5.0, 0.0, 0.0]  # back to 0 at the abort
    assert "ttft: median 81.0 ms" in aborted["analysis: abort"].text[0]
    assert list(aborted["aborted"].y) == [0.0]

    promoted = {t.name: t for t in rf.release_timeline(decode(ReleaseView, PROMOTED)).data}
    assert list(promoted["v2 share (%)"].y)[-1] == 100.0
    assert set(promoted) >= {"promoting", "promoted", "analysis: next step"}


def test_no_release_and_a_release_before_its_first_step_are_said_plainly() -> None:
    none = rf.release_timeline(None)
    assert none.data == () and none.layout.annotations[0].text == "no release yet"
    starting = decode(ReleaseView, {**RUNNING, "steps": RUNNING["steps"][:1]})
    assert "replicas are starting" in rf.release_timeline(starting).layout.annotations[0].text
    assert "no release yet" in text(rf.release_summary(None))
    assert "no step analysed yet" in text(rf.analysis_tables(None)[0])


def test_each_analysis_is_a_table_of_both_sides_per_metric_newest_first() -> None:
    release = decode(ReleaseView, ABORTED)
    [table] = rf.analysis_tables(release)
    assert table.to_plotly_json()["props"]["data-decision"] == "abort"
    title = text(table.children[0])
    assert title.startswith("Analysis 1: 5% of traffic, window ") and title.endswith("(60 s): fail -> abort")
    head, *rows = table.children[1].children
    assert text(head).split(" | ") == list(rf.ANALYSIS_HEAD)
    assert len(rows) == 6  # three metrics, stable and canary each
    cells = {(r.to_plotly_json()["props"]["data-metric"], r.to_plotly_json()["props"]["data-side"]):
             text(r).split(" | ") for r in rows}
    ttft_stable, ttft_canary = cells["ttft", "stable"], cells["ttft", "canary"]
    assert ttft_stable == ["ttft", "mann-whitney-u (one-sided)", "stable", "400", "2", "0.50%", "50.0",
                           "80.0", "95.5", "1e-05", "×1.62", "fail", "median 81.0 ms against 50.0 ms"]
    assert ttft_canary == ["canary", "30", "0", "0.00%", "81.0", "120.0", "140.0"]
    assert cells["errors", "stable"][3:10] == ["400", "2", "0.50%", "–", "–", "–", "1"]
    assert cells["errors", "stable"][10] == "-0.50 pp"
    assert cells["tpot", "stable"][9:12] == ["not tested", "–", "inconclusive"]

    running = rf.analysis_tables(decode(ReleaseView, RUNNING))
    assert [t.to_plotly_json()["props"]["data-step"] for t in running] == ["2", "1"]  # newest first


def test_the_versions_table_marks_the_current_version() -> None:
    view = decode(VersionsView, {"current": "v2", "versions": [
        {"name": "v1", "model": "default", "created": T0 - 5000, "notes": "first", "last_analysis": None},
        {"name": "v2", "model": "/models/v2", "created": T0 - 3000, "notes": "",
         "last_analysis": {"share": 1.0, "decision": "next", "verdict": "pass", "metrics": []}}]})
    head, v1, v2 = rf.version_rows(view)
    assert text(head).split(" | ") == ["version", "model", "created (UTC)", "notes", "last analysis"]
    assert v1.to_plotly_json()["props"]["data-current"] == "false" and "first" in text(v1)
    assert v2.to_plotly_json()["props"]["data-current"] == "true" and "current" in text(v2)
    assert text(v2).endswith("pass at 100% -> next")
    assert "no version registered yet" in text(rf.version_rows(VersionsView(current=None))[1])


def test_the_summary_and_history_say_what_each_release_did() -> None:
    view = rollouts(None, [ABORTED, PROMOTED])
    shown = rf.shown_release(view)
    assert shown is not None and shown.id == 2 and not rf.is_live(shown)  # the latest, when none runs
    summary = text(rf.release_summary(shown))
    assert "Release 2: v2-slow (from v2), canary: aborted" in summary
    assert "share now 5%" in summary and "steps 5, 20, 50, 100% every 60.0 s" in summary
    assert "reason: ttft: median 81.0 ms" in summary
    head, aborted, promoted = rf.history_rows(view.history)
    assert text(head).split(" | ") == list(rf.HISTORY_HEAD)
    assert text(aborted).split(" | ")[:5] == ["2", "v2-slow", "v2", "canary", "aborted"]
    assert text(promoted).split(" | ")[7:9] == ["100%", "2"]
    assert rf.shown_release(rollouts(RUNNING, [RUNNING, ABORTED])).id == 3  # type: ignore[union-attr]
    assert "no release yet" in text(rf.history_rows(())[1])


@pytest.mark.parametrize("steps, expected", [("5,20,50,100", [5, 20, 50, 100]), ("10% 100%", [10, 100]),
                                             (" 100 ", [100])])
def test_steps_are_percents_ending_at_100(steps: str, expected: list[float]) -> None:
    assert rf.parse_steps(steps) == expected


@pytest.mark.parametrize("steps, message", [("", "give the steps"), ("5,x", "not a list"),
                                            ("20,5,100", "increasing"), ("5,20,50", "must be 100"),
                                            ("0,100", "increasing")])
def test_bad_steps_are_refused_with_a_message(steps: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rf.parse_steps(steps)


class FakeApi:
    """The typed client as the page's actions use it: records the calls, or refuses them."""

    def __init__(self, refuse: ApiError | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refuse = refuse

    def start_canary(self, version: str, **policy: Any) -> ReleaseView:
        self.calls.append(("start", version, policy))
        if self.refuse:
            raise self.refuse
        return decode(ReleaseView, {**RUNNING, "version": version, "steps": []})

    def release_action(self, release_id: int, action: str, reason: str = "") -> ReleaseView:
        self.calls.append((action, release_id, reason))
        if self.refuse:
            raise self.refuse
        return decode(ReleaseView, {**RUNNING, "outcome": "paused" if action == "pause" else "running"})


@pytest.fixture(scope="module")
def page() -> Any:
    from dashboards.app import ConsoleConfig, create_console

    create_console("http://127.0.0.1:1", ConsoleConfig(secret="s" * 32))  # registers the pages
    from dashboards.pages import rollouts as page

    return page


def test_the_actions_send_the_form_and_show_a_refusal_as_a_note(page: Any) -> None:
    api = FakeApi()
    done = page.start_canary(api, "v3", "5,20,100", (30.0, None, 2, ""))
    assert api.calls == [("start", "v3", {"steps": [5.0, 20.0, 100.0], "interval_s": 30.0, "replicas": 2})]
    assert done.id == "ro-started" and text(done) == "release 3 started: canary of v3"
    bad = page.start_canary(api, "v3", "5,20", (None,) * 4)
    assert bad.id == "ro-start-refused" and "must be 100" in text(bad) and len(api.calls) == 1
    assert page.start_canary(api, None, "5,100", (None,) * 4).id == "ro-start-refused"

    paused = page.release_action(api, 3, "pause", " night ")
    assert api.calls[-1] == ("pause", 3, "night") and "pause accepted, now paused" in text(paused)
    refused = FakeApi(ApiError("release 3 has ended (aborted)", status=409))
    note = page.release_action(refused, 3, "promote", "")
    assert note.id == "ro-action-refused" and note.className == "notice"
    assert text(note) == "promote refused: release 3 has ended (aborted)"
    assert "Traceback" not in text(page.start_canary(refused, "v3", "100", (None,) * 4))
    assert page.release_action(api, None, "abort", "").id == "ro-action-refused"


def test_the_controls_follow_the_release_and_the_role(page: Any) -> None:
    running, aborted = decode(ReleaseView, RUNNING), decode(ReleaseView, ABORTED)
    paused = decode(ReleaseView, {**RUNNING, "outcome": "paused"})
    # promote, abort, pause, resume: True is disabled
    assert page._disabled(running, True) == (False, False, False, True)
    assert page._disabled(paused, True) == (False, False, True, False)
    assert page._disabled(aborted, True) == (True, True, True, True)
    assert page._disabled(None, True) == (True, True, True, True)
    assert page._disabled(running, False) == (True, True, True, True)  # a viewer
