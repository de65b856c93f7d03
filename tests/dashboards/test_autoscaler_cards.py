"""The autoscaler page's "replicas vs profile" card: the last decision's drift, and the shares of the
engines' step time on a core and waiting for one where the replicas count them
(``controlplane.autoscale.drift``)."""

from __future__ import annotations

from typing import Any

from controlplane.client import Decision, DecisionInputs
from dashboards.figures import profile_drift_text


def decision(drift: dict[str, Any] | None) -> Decision:
    inputs = DecisionInputs(current=2, ready=2, starting=0, metrics={}, profile_drift=drift)
    return Decision(at=0.0, mode="active", inputs=inputs, proposals=(), final=2, applied=False, outcome="")


def test_the_card_shows_the_drift_and_the_share_on_a_core() -> None:
    waiting = {"ratio": 1.6, "stale": True, "busy_s_per_s": 1.6, "predicted_s_per_s": 1.0, "on_cpu": 0.8}
    assert profile_drift_text(decision(waiting)) == "1.60x, 80% on a core (stale: run controlplane calibrate)"
    split = {**waiting, "waiting_core": 0.05}  # the other 15% on the interpreter lock
    assert profile_drift_text(decision(split)) == ("1.60x, 80% on a core, 5% waiting for one (stale: run "
                                                   "controlplane calibrate)")
    older = {"ratio": 1.1, "stale": False, "busy_s_per_s": 1.1, "predicted_s_per_s": 1.0}  # no CPU counter
    assert profile_drift_text(decision(older)) == "1.10x"
    assert profile_drift_text(decision(None)) == profile_drift_text(None) == "– (replicas too idle to judge)"
