"""Request traces for the fleet simulator: Azure LLM trace replay and a seeded synthetic bursty trace.

A trace is a list of :class:`SimRequest` (arrival offset in seconds, prompt and output lengths, and for a
prompt that opens with a prefix other requests share, which one and its length). Replay of
the Azure CSV format reuses the load client's reader (``inference.bench.datasets``) so the simulator and a
live replay see the same requests; ``compress`` divides arrival offsets (4: four times the request rate) and
``token_scale`` multiplies lengths, to fit a trace recorded on large GPUs onto a small fleet.

The synthetic trace is a Markov-modulated Poisson process with three states (idle, steady, burst) and
exponential dwell times, so a policy is also shown on a shape it was not developed against: sudden bursts
several times the steady rate, and idle gaps.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from inference.bench.datasets import DatasetConfig, read_trace, trace_requests


@dataclass(slots=True, frozen=True)
class SimRequest:
    index: int
    arrival: float  # seconds from the start of the trace
    prompt_len: int
    output_len: int
    # the prompt's first ``prefix_len`` tokens are the same in every request of the same ``prefix_id`` (a
    # system prompt, a shared document); 0: none shared. A replica whose prefix cache holds them skips them.
    prefix_id: int = 0
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.arrival < 0 or self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"request {self.index}: need arrival >= 0 and lengths >= 1")
        if self.prefix_id < 0 or not 0 <= self.prefix_len <= self.prompt_len or (
                self.prefix_id == 0 and self.prefix_len):
            raise ValueError(f"request {self.index}: a shared prefix needs an id >= 1 and 0..prompt_len "
                             "tokens (id 0: none, 0 tokens)")


@dataclass(slots=True, frozen=True)
class TraceShape:
    """How a trace is fitted to the fleet: time compression, token scaling, a window, length caps."""

    compress: float = 1.0
    token_scale: float = 1.0
    start_s: float = 0.0  # seconds into the trace, before compression
    duration_s: float | None = None  # seconds of the trace kept, before compression
    max_prompt_len: int | None = None
    max_output_len: int | None = None

    def __post_init__(self) -> None:
        if not (self.compress > 0 and math.isfinite(self.compress)):
            raise ValueError(f"compress: must be > 0, got {self.compress!r}")
        if not (self.token_scale > 0 and math.isfinite(self.token_scale)):
            raise ValueError(f"token_scale: must be > 0, got {self.token_scale!r}")
        if self.start_s < 0 or (self.duration_s is not None and self.duration_s <= 0):
            raise ValueError("start_s must be >= 0 and duration_s > 0")

    @classmethod
    def fitted(cls, max_model_len: int, *, compress: float = 1.0, token_scale: float = 1.0,
               duration_s: float | None = None) -> TraceShape:
        """A shape whose requests fit a replica's context: prompts capped at 3/4 of it, outputs at 1/4."""
        return cls(compress=compress, token_scale=token_scale, duration_s=duration_s,
                   max_prompt_len=max_model_len * 3 // 4, max_output_len=max_model_len // 4)


def azure_trace(path: str | Path, shape: TraceShape = TraceShape()) -> list[SimRequest]:
    """Requests of an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens); ``azure``
    is the trace shipped with the load client (or ``$CONTROLPLANE_AZURE_TRACE``)."""
    cfg = DatasetConfig(
        name=f"trace:{path}",
        time_scale=shape.compress,
        token_scale=shape.token_scale,
        trace_start=shape.start_s,
        trace_duration=shape.duration_s,
        max_input_len=shape.max_prompt_len,
        max_output_len=shape.max_output_len,
    )
    rows = read_trace(cfg.trace_path)
    return [
        SimRequest(r.index, r.arrival or 0.0, r.prompt_len, r.output_len) for r in trace_requests(rows, cfg)
    ]


@dataclass(slots=True, frozen=True)
class BurstyConfig:
    """Three-state Markov-modulated Poisson arrivals; rates in requests/s at trace scale (before shaping).

    Lengths are log-normal around the Azure conversation trace's medians, so the same ``TraceShape``
    fits both traces to the fleet.
    """

    duration_s: float = 3600.0
    seed: int = 0
    rates: tuple[float, float, float] = (0.5, 4.0, 14.0)  # idle, steady, burst
    mean_dwell_s: tuple[float, float, float] = (120.0, 300.0, 60.0)
    # from each state, the probability of moving to (idle, steady, burst)
    transitions: tuple[tuple[float, float, float], ...] = ((0.0, 0.7, 0.3), (0.3, 0.0, 0.7), (0.2, 0.8, 0.0))
    prompt_median: float = 1020.0
    prompt_sigma: float = 0.9
    output_median: float = 129.0
    output_sigma: float = 0.8
    max_prompt_len: int = 14_000
    max_output_len: int = 2_000

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or any(r < 0 for r in self.rates) or any(d <= 0 for d in self.mean_dwell_s):
            raise ValueError("duration_s and dwell times must be > 0, rates >= 0")
        for row in self.transitions:
            if len(row) != 3 or abs(sum(row) - 1.0) > 1e-9:
                raise ValueError(f"transitions: each row must hold 3 probabilities summing to 1, got {row}")


def synthetic_bursty(
    config: BurstyConfig = BurstyConfig(), shape: TraceShape = TraceShape()
) -> list[SimRequest]:
    """A seeded bursty trace: the same seed always gives the same requests."""
    rng = random.Random(f"bursty:{config.seed}")
    raw: list[tuple[float, int, int]] = []
    now, state = 0.0, 1
    while now < config.duration_s:
        dwell_end = min(now + rng.expovariate(1.0 / config.mean_dwell_s[state]), config.duration_s)
        rate = config.rates[state]
        t = now + (rng.expovariate(rate) if rate > 0 else math.inf)
        while t < dwell_end:
            raw.append(
                (
                    t,
                    _lognormal(rng, config.prompt_median, config.prompt_sigma, config.max_prompt_len),
                    _lognormal(rng, config.output_median, config.output_sigma, config.max_output_len),
                )
            )
            t += rng.expovariate(rate)
        now, state = dwell_end, rng.choices((0, 1, 2), weights=config.transitions[state])[0]
    return shaped(raw, shape)


def _lognormal(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma)))))


# (arrival, prompt, output) at trace scale, or with (prefix id, prefix tokens) after them
RawRow = tuple[float, int, int] | tuple[float, int, int, int, int]


def shaped(raw: Sequence[RawRow], shape: TraceShape) -> list[SimRequest]:
    """Rows at trace scale, cut to the window, compressed and token-scaled (a shared prefix scaled as its
    prompt is, and never longer than the prompt once capped)."""
    end = math.inf if shape.duration_s is None else shape.start_s + shape.duration_s
    out: list[SimRequest] = []
    for row in raw:
        t, p, o, *shared = row
        if not shape.start_s <= t < end:
            continue
        prompt = _scale(p, shape.token_scale, shape.max_prompt_len)
        prefix_id, prefix = shared if shared else (0, 0)
        prefix = min(round(prefix * shape.token_scale), prompt) if prefix_id else 0
        out.append(SimRequest(len(out), (t - shape.start_s) / shape.compress, prompt,
                              _scale(o, shape.token_scale, shape.max_output_len), prefix_id, prefix))
    return out


def _scale(count: int, scale: float, cap: int | None) -> int:
    scaled = max(1, round(count * scale))
    return scaled if cap is None else min(scaled, cap)


def trace_duration(requests: list[SimRequest]) -> float:
    return max((r.arrival for r in requests), default=0.0)
