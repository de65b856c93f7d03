"""A table of rows with buttons is drawn again only when what its rows are changes
(:mod:`dashboards.live_rows`): the browser tests show the buttons outliving the refresh; these, the choice."""

from __future__ import annotations

import dash

from dashboards import live_rows


def test_rows_are_drawn_once_while_their_identity_holds() -> None:
    identity = (True, [(3, "pause", "az-b-1")])
    rows, key = live_rows.redraw(identity, None, lambda: ["row 3"])
    assert rows == ["row 3"] and isinstance(key, str)
    assert live_rows.redraw((True, [(3, "pause", "az-b-1")]), key, lambda: ["row 3"]) == (dash.no_update,) * 2


def test_rows_are_drawn_again_when_a_row_or_the_role_changes() -> None:
    fault = (3, "pause", "az-b-1")
    _, key = live_rows.redraw((True, [fault]), None, list)
    for changed in ((False, [fault]), (True, [fault, (4, "kill", "az-a-1")]), (True, [])):
        rows, new_key = live_rows.redraw(changed, key, lambda: ["drawn"])
        assert rows == ["drawn"] and new_key != key, changed


def test_live_values_are_kept_by_row_index_as_text() -> None:
    assert live_rows.live({"chaos-left": {3: "12 s", None: "1 s"}}) == {"chaos-left": {"3": "12 s",
                                                                                      "None": "1 s"}}
