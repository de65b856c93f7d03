"""The control plane's side of traffic slices: the plan it publishes to the gateways, and what they saw.

One :class:`TrafficSlices` per control plane holds the slice plan: a canary's version and share (set by the
canary controller, :mod:`controlplane.rollouts.canary`) and the colours of a slice experiment
(:mod:`controlplane.rollouts.experiment`). The endpoints feed publishes :meth:`TrafficSlices.plan` to every
gateway with the replica set (a change reaches them within the long poll's 0.1 s look, and gateways keep
the last plan while the control plane is away). The plan is kept in the store, so a control plane
restarted mid-canary publishes the same split.

:meth:`TrafficSlices.outcomes` reads each gateway's per-slice outcomes (``GET /admin/slices``) and merges
them: the samples the analyses compare.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from controlplane.gateway.slices import Outcome, Share, SlicePlan

logger = logging.getLogger(__name__)

PLAN_KEY = "rollouts.slices"


class PlanStore(Protocol):
    def kv_put(self, key: str, value: Any) -> None: ...
    def kv_get(self, key: str, default: Any = None) -> Any: ...


# Reads every gateway's outcomes since a wall-clock time: {gateway: {slice: [Outcome, ...]}}.
OutcomeSource = Callable[[float], Awaitable[Mapping[str, Mapping[str, list[Outcome]]]]]


class TrafficSlices:
    def __init__(self, store: PlanStore, outcomes: OutcomeSource | None = None) -> None:
        self.store = store
        self._outcomes = outcomes
        self._lock = threading.Lock()
        try:
            self._plan = SlicePlan.from_json(store.kv_get(PLAN_KEY))
        except (ValueError, TypeError) as exc:
            logger.error("the stored slice plan is unreadable, starting from none: %s", exc)
            self._plan = SlicePlan()

    def plan(self) -> SlicePlan:
        return self._plan

    def set_split(self, version: str, share: float) -> SlicePlan:
        """Send ``share`` of requests to ``version`` (0 removes it from the split)."""
        with self._lock:
            others = tuple(s for s in self._plan.split if s.name != version)
            split = others + ((Share(version, share),) if share > 0 else ())
            return self._replace(SlicePlan(split=split, colours=self._plan.colours))

    def clear_split(self) -> SlicePlan:
        with self._lock:
            return self._replace(SlicePlan(colours=self._plan.colours))

    def set_colours(self, colours: Mapping[str, float]) -> SlicePlan:
        """Colour these shares of requests (an empty mapping: no colours)."""
        with self._lock:
            shares = tuple(Share(name, share) for name, share in sorted(colours.items()) if share > 0)
            return self._replace(SlicePlan(split=self._plan.split, colours=shares))

    def _replace(self, plan: SlicePlan) -> SlicePlan:
        self.store.kv_put(PLAN_KEY, plan.to_json())  # durable before any gateway sees it
        self._plan = plan
        logger.info("traffic slices now %s", plan.to_json())
        return plan

    async def outcomes(self, since: float) -> dict[str, list[Outcome]]:
        """Every gateway's outcomes per slice since ``since`` (wall clock), merged, oldest first."""
        if self._outcomes is None:
            return {}
        merged: dict[str, list[Outcome]] = {}
        for per_slice in (await self._outcomes(since)).values():
            for name, outcomes in per_slice.items():
                merged.setdefault(name, []).extend(outcomes)
        for outcomes in merged.values():
            outcomes.sort(key=lambda o: o.at)
        return merged
