"""Tables whose rows carry buttons (revert a fault, switch a rule, pause a schedule): a page's refresh draws
the rows again only when what they are changes, and sends the values that move every tick (time left,
counts, last evaluation, next run) to the rows' live cells instead.

Why: a callback whose Input is a pattern-matched set of buttons fires again each time its buttons are drawn,
and dash-renderer keeps only the newest answer of a callback in flight (plotly/dash#943). A table drawn
again on every tick lets that "nobody clicked" call supersede a click's: the action is done, its message
is never shown, and the button under the pointer is replaced.

A page's refresh callback returns :func:`redraw`'s pair (the rows, or nothing when the key it drew last,
kept in a ``dcc.Store``, still holds) and :func:`live` values into another store; :func:`fill_cells`
registers the callback that copies those values into the :func:`cell` of each row. An error drawn in
place of the rows stores no key: it has no buttons, and the next answer draws the rows again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import dash
from dash import ALL, Input, Output, ctx, html

Values = Mapping[str, Mapping[Any, str]]  # cell kind -> row index -> text


def cell(kind: str, index: str | int | None, text: str, **attrs: Any) -> html.Td:
    """A cell whose text :func:`fill_cells` replaces, found by ``kind`` and the row's ``index``."""
    return html.Td(text, id={"type": kind, "index": index}, **attrs)


def redraw(identity: object, drawn: str | None, draw: Callable[[], Any]) -> tuple[Any, Any]:
    """``(draw(), key)``, or ``no_update`` twice while the rows' ``identity`` (every value a row shows that
    does not move by itself, and whatever decides its buttons) hashes to the key ``drawn`` last."""
    text = json.dumps(identity, default=str, sort_keys=True, separators=(",", ":"))
    key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    if key == drawn:
        return dash.no_update, dash.no_update
    return draw(), key


def live(values: Values) -> dict[str, dict[str, str]]:
    """The live values as a ``dcc.Store`` keeps them (JSON: row indexes as text)."""
    return {kind: {str(index): text for index, text in cells.items()} for kind, cells in values.items()}


def fill_cells(store: str, *kinds: str) -> None:
    """Register the callback that writes the ``store``'s live values into the cells of ``kinds``; a cell
    the values do not name (its row has just gone) is left alone."""

    @dash.callback([Output({"type": kind, "index": ALL}, "children") for kind in kinds], Input(store, "data"))
    def fill(values: dict[str, dict[str, str]] | None) -> list[list[Any]]:
        found = values or {}
        return [[found.get(kind, {}).get(str(out["id"]["index"]), dash.no_update) for out in outputs]
                for kind, outputs in zip(kinds, ctx.outputs_list, strict=True)]
