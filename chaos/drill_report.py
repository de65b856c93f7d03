"""A drill's report concluded: the verdict against the scenario's targets, the figures and the timeline
as the report gives them, and the status.

Where it sits: :class:`chaos.drills.DrillRunner` keeps a drill's report while the drill runs (config,
steady state, load, targets, events) and, once the faults are reverted, measures: the client's timeline
and its figures (:mod:`chaos.drill_figures`), the requests the gateway resumed and the acknowledged writes
lost (through its port), and the slice experiment's record when the scenario ran one. It hands them to
:func:`conclude`, which adds the figures only some scenarios have (a slice experiment's, the clients a
killed gateway lost), checks the figures against the scenario's targets and writes the figures (times
relative to t0), the checks, the timeline series and the status (passed or failed) into the report. Pure:
no I/O, no clock. What people read is rendered from the stored report by :mod:`controlplane.drills.report`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from chaos.drill_figures import ClientRequest, Figures, FleetSample, client_loss, timeline_series, verdict
from chaos.scenarios import Scenario


def conclude(report: dict[str, Any], fig: Figures, requests: Sequence[ClientRequest],
             samples: Sequence[FleetSample], sc: Scenario, *, t0: float,
             slice_record: Mapping[str, Any] | None) -> None:
    """The verdict into ``report``: ``fig`` derived from the client's ``requests`` and the fleet
    ``samples`` with the fault at ``t0``; ``slice_record`` the slice experiment's record (None when the
    scenario ran none, or it outlived the drill's observation: its figures then fail)."""
    if slice_record is not None:
        report["slice_experiment"] = slice_record
        _slice_figures(fig, slice_record)
    if sc.action == "gateway-crash":  # every client of the killed gateway is hit, whatever replica
        loss = client_loss(requests, t0)
        fig.rto_service_s = None if math.isinf(loss.rto_service_s) else loss.rto_service_s
        report["client_loss"] = dataclasses.asdict(loss)
    checks = verdict(fig, sc.targets)
    report["figures"] = fig.relative()
    report["checks"] = [dataclasses.asdict(c) for c in checks]
    report["timeline"] = timeline_series(requests, samples, t0)
    report["status"] = "passed" if all(c.ok for c in checks) else "failed"


def _slice_figures(fig: Figures, record: Mapping[str, Any]) -> None:
    """The slice experiment's figures, from its record."""
    result, stopped = record.get("report") or {}, record.get("stopped") or {}
    fig.uncoloured_failed = (result.get("uncoloured") or {}).get("failed")
    fig.slice_stop_s = stopped.get("after_s") if stopped.get("reason") == "deviation" else None
    fig.slice_sides_missing = sum(1 for side in ("experiment", "control")
                                  if not (result.get(side) or {}).get("requests"))
