"""What the autoscaler observes each tick: fleet-level inputs read from telemetry into an
:class:`~controlplane.autoscale.decide.Observation` (waiting requests, KV-cache usage, P95 TTFT, generated
tokens/s and offered engine load per ready replica; the request rate, over the metrics and panic windows).
The offered engine load uses the requests that finished in the window (``vllm:prompt_tokens_total`` and
``vllm:generation_tokens_total`` over ``vllm:request_success_total``, each pair read on the same samples:
:meth:`~controlplane.telemetry.base.Telemetry.ratio`), less the share of prompt tokens the replicas'
prefix caches held (``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``).
The replicas' engine time against the profile's prediction (:mod:`controlplane.autoscale.drift`) goes
into the record, not into the sizing.
The spread of their prompt lengths comes from ``llmsre_prompt_tokens_squared_total`` beside them (the
autoscaler's M/G/c prefill queue), and that of their output lengths from
``llmsre_generation_tokens_squared_total`` (its TPOT tail).

The request rate is what reached the replicas plus what the gateways refused for want of capacity
(``refused``: :class:`~controlplane.fleet.refusals.RefusalCounts`): a fleet whose gateways shed would
otherwise be sized on the load it admitted, and never grow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from controlplane.autoscale.decide import METRICS, Observation, offered_engine_load, per_replica
from controlplane.autoscale.drift import observe_drift
from controlplane.autoscale.profile import ReplicaProfile
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.telemetry.base import (
    GENERATION_TOKENS,
    HTTP_REQUESTS,
    INFERENCE_PATHS,
    KV_USAGE,
    NUM_WAITING,
    REQUEST_SUCCESS,
    TTFT,
    Regex,
    Telemetry,
    TelemetryError,
)

PROMPT_TOKENS = "vllm:prompt_tokens_total"  # incremented when a request finishes, as generation tokens are
PREFIX_HITS = "vllm:prefix_cache_hits_total"  # prompt tokens found in a replica's prefix cache
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"  # prompt tokens looked up, on admission
PROMPT_TOKENS_SQUARED = "llmsre_prompt_tokens_squared_total"  # with it, the spread of prompt lengths
GENERATION_TOKENS_SQUARED = "llmsre_generation_tokens_squared_total"  # and of output lengths


def observe_telemetry(telemetry: Telemetry, endpoints: list[ReplicaEndpoint], *, now: float, wall: float,
                      current: int, window_s: float | None, profile: ReplicaProfile,
                      panic_window_s: float,
                      refused: Callable[[float], float | None] | None = None) -> Observation:
    """Fleet-level inputs from per-replica series; averages are over ready replicas (HPA's AverageValue).
    ``refused(window_s)``: requests per second the gateways refused for want of capacity, added to the
    request rates (None from it: not known yet, nothing added)."""
    ready = [e.replica_id for e in endpoints if e.state is ReplicaState.READY]
    starting = sum(1 for e in endpoints if e.state is ReplicaState.STARTING)
    notes: list[str] = []
    inference = {"path": Regex(INFERENCE_PATHS)}
    try:
        waiting = telemetry.gauge(NUM_WAITING)
        kv = telemetry.gauge(KV_USAGE, agg="max")
        tokens = telemetry.rate(GENERATION_TOKENS, window_s=window_s)
        rate = telemetry.rate(HTTP_REQUESTS, window_s=window_s, by=(), match=inference).get(())
        ttft = telemetry.quantile(TTFT, 0.95, window_s=window_s, by=()).get(())
        short = telemetry.rate(HTTP_REQUESTS, window_s=panic_window_s, by=(), match=inference).get(())
        mean_prompt = telemetry.ratio(PROMPT_TOKENS, REQUEST_SUCCESS, window_s=window_s)
        mean_output = telemetry.ratio(GENERATION_TOKENS, REQUEST_SUCCESS, window_s=window_s)
        mean_square = telemetry.ratio(PROMPT_TOKENS_SQUARED, REQUEST_SUCCESS, window_s=window_s)
        output_square = telemetry.ratio(GENERATION_TOKENS_SQUARED, REQUEST_SUCCESS, window_s=window_s)
        prefix_hits = telemetry.ratio(PREFIX_HITS, PREFIX_QUERIES, window_s=window_s)
        drift = observe_drift(telemetry, profile, window_s=window_s)
    except TelemetryError as exc:
        notes.append(f"telemetry unavailable: {exc}")
        return Observation(now, wall, current, len(ready), starting, dict.fromkeys(METRICS),
                           notes=tuple(notes))
    if ttft is None and rate is not None and rate == 0:
        ttft = 0.0  # no request in the window: nothing waited for a first token
        notes.append("ttft_p95_s: no request in the window, counted as 0")
    if drift is not None and (stale := drift.note()) is not None:
        notes.append(stale)
    if short is None and rate is not None:
        short = rate  # the panic window holds too few scrapes for a rate: the metrics window stands in
        notes.append(f"request rate over {panic_window_s:g}s unknown: the metrics window's used")
    shed = None
    if refused is not None:
        shed = refused(window_s or telemetry.window_s)
        shed_short = refused(panic_window_s)
        if shed:
            rate = (rate or 0.0) + shed
            notes.append(f"{shed:.3g} requests/s refused by the gateways for want of capacity: counted in "
                         "the request rate")
        if shed_short:
            short = (short or 0.0) + shed_short
    load = offered_engine_load(profile, request_rate=rate, mean_prompt_tokens=mean_prompt,
                               mean_output_tokens=mean_output, prefix_hit_share=prefix_hits)
    if load is None and rate:
        notes.append("engine_load_per_replica: no request finished in the window to size the load")
    metrics = {"waiting_per_replica": _mean(waiting, ready), "kv_cache_usage": _mean(kv, ready),
               "ttft_p95_s": ttft, "tokens_per_s_per_replica": _mean(tokens, ready),
               "engine_load_per_replica": per_replica(load, len(ready))}
    demand = offered_engine_load(profile, request_rate=short, mean_prompt_tokens=mean_prompt,
                                 mean_output_tokens=mean_output, prefix_hit_share=prefix_hits)
    # a panic window's rate counts the arrivals between its first and last scrapes (at least one interval)
    interval = telemetry.scrape_interval_s
    counted = max(panic_window_s - interval, interval) if 0 < interval < panic_window_s else None
    return Observation(now, wall, current, len(ready), starting, metrics, demand, rate, tuple(notes),
                       short, mean_prompt, mean_output, refused_rate=shed, drift=drift,
                       prefix_hit_share=prefix_hits, panic_counted_s=counted,
                       prompt_tokens_sd=_sd(mean_prompt, mean_square),
                       output_tokens_sd=_sd(mean_output, output_square),
                       rate_window_s=window_s or telemetry.window_s)


def _sd(mean: float | None, mean_square: float | None) -> float | None:
    """The standard deviation of the prompt (or output) lengths of the requests that finished in the
    window, from their mean and mean square; None when unknown (replicas that do not export the sum of
    squares: the prefill queue is then taken as M/M/c, the outputs as geometric)."""
    if mean is None or mean_square is None:
        return None
    return math.sqrt(max(mean_square - mean * mean, 0.0))


def _mean(values: Mapping[tuple[str, ...], float], replicas: list[str]) -> float | None:
    known = [values[(r,)] for r in replicas if (r,) in values and math.isfinite(values[(r,)])]
    return sum(known) / len(known) if known else None
