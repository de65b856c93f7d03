"""Expert load of a mixture-of-experts fleet: how many tokens each replica routes to each expert.

A replica serving a mixture-of-experts model exports, beside vLLM's series (``inference/metrics.py``),

- ``llmsre_moe_expert_tokens_total{expert="0".."E-1"}``: a counter of the tokens routed to each expert,
  summed over the model's MoE layers;
- ``llmsre_moe_expert_load_imbalance``: the busiest expert's tokens over the mean, in the most unbalanced
  layer, since the replica started (1 is even; 0 before any token).

A dense model exports neither: :func:`expert_load` then answers no experts and no replicas, which the
console shows as "this model has no experts". Both telemetry sources answer the same three queries::

    sum by (replica, expert) (rate(llmsre_moe_expert_tokens_total[W]))   tokens/s over the window
    sum by (replica, expert) (llmsre_moe_expert_tokens_total)             tokens since the replica started
    max by (replica) (llmsre_moe_expert_load_imbalance)                   imbalance since start

(``replica`` is the fleet's label, set by the scrape configuration; the page's own echo is dropped.)

Where it sits: ``GET /api/v1/metrics/experts`` (:mod:`controlplane.api.experts`) answers
:class:`ExpertLoad` as JSON, the console's Overview draws it as a heatmap (replicas x experts).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from controlplane.telemetry.base import Scope, Telemetry

EXPERT_TOKENS = "llmsre_moe_expert_tokens_total"
EXPERT_IMBALANCE = "llmsre_moe_expert_load_imbalance"
BY_EXPERT = ("replica", "expert")


@dataclass(slots=True, frozen=True)
class ReplicaExpertLoad:
    """One replica's row of the heatmap; the tuples follow :attr:`ExpertLoad.experts` (None: no data for
    that expert, such as a rate before the second scrape, or an expert this replica's model lacks)."""

    replica: str
    tokens_per_s: tuple[float | None, ...]  # over the window
    tokens_total: tuple[float | None, ...]  # since the replica started
    imbalance: float | None  # the replica's gauge: worst layer, since start (1 is even; 0 before any token)
    recent_imbalance: float | None  # busiest expert's tokens/s over the mean in the window (all layers)


@dataclass(slots=True, frozen=True)
class ExpertLoad:
    """Expert load of every replica of a scope; no experts (and no replicas): the model is dense."""

    scope: str
    window_s: float
    observed_at: float  # the source's monotonic seconds
    experts: tuple[str, ...]  # expert ids, in numeric order
    replicas: tuple[ReplicaExpertLoad, ...]

    @property
    def is_moe(self) -> bool:
        return bool(self.experts)


def expert_load(telemetry: Telemetry, scope: Scope | None = None, *,
                window_s: float | None = None) -> ExpertLoad:
    """Per replica and per expert: tokens/s over the window, tokens since start, and the imbalance."""
    scope = scope or Scope()
    window = telemetry.window_s if window_s is None else window_s
    if not window > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    match = scope.matchers
    rates = telemetry.rate(EXPERT_TOKENS, window_s=window, by=BY_EXPERT, match=match)
    totals = telemetry.gauge(EXPERT_TOKENS, by=BY_EXPERT, match=match)
    gauges = telemetry.gauge(EXPERT_IMBALANCE, by=("replica",), match=match, agg="max")
    experts = tuple(sorted({e for _, e in (*rates, *totals) if e}, key=_expert_order))
    replicas = sorted({r for r, e in (*rates, *totals) if r and e})
    rows = []
    for rid in replicas:
        per_s = tuple(rates.get((rid, e)) for e in experts)
        rows.append(ReplicaExpertLoad(
            replica=rid, tokens_per_s=per_s, tokens_total=tuple(totals.get((rid, e)) for e in experts),
            imbalance=gauges.get((rid,)), recent_imbalance=max_over_mean(per_s)))
    return ExpertLoad(scope=str(scope), window_s=window, observed_at=telemetry.now(), experts=experts,
                      replicas=tuple(rows))


def max_over_mean(values: Iterable[float | None]) -> float | None:
    """The busiest over the mean of the known values; None when none is known or all are 0."""
    known = [v for v in values if v is not None]
    total = sum(known)
    if not known or total <= 0:
        return None
    return max(known) * len(known) / total


def _expert_order(expert: str) -> tuple[int, int, str]:
    """"2" before "10"; a non-numeric id (none today) after the numbers, by name."""
    return (0, int(expert), "") if expert.isdigit() else (1, 0, expert)

