"""The load the autoscaler sizes the fleet on: the steady load of the ticks' rates, and surges in the panic
window. Part of :mod:`controlplane.autoscale.decide`, which sizes the work (:func:`~controlplane.autoscale.
decide.with_work`) at :func:`steady_load`, or at a :func:`surge` where that needs more, and keeps the ticks'
samples in its :class:`~controlplane.autoscale.decide.LoopState` (:func:`load_after`).

A window's rate carries its Poisson counting noise (about +-8% at 5 requests/s over 30 s). The steady load
averages it away over the ticks since the load last changed, follows a trend beyond noise, takes a change
beyond :func:`change_z` standard errors at once, and believes a fleet that shows itself short. A burst shows
in the 6 s panic window before the 30 s window: a count there that a Poisson count at the steady load
reaches about once a day is a surge.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Protocol

from controlplane.autoscale.config import AutoscalerConfig
from controlplane.autoscale.work import poisson_at_least


class Observation(Protocol):
    """What a tick's load is read from (:class:`controlplane.autoscale.decide.Observation` has it)."""

    @property
    def now(self) -> float: ...
    @property
    def metrics(self) -> Mapping[str, float | None]: ...
    @property
    def request_rate(self) -> float | None: ...
    @property
    def rate_window_s(self) -> float | None: ...
    @property
    def mean_prompt_tokens(self) -> float | None: ...
    @property
    def mean_output_tokens(self) -> float | None: ...
    @property
    def panic_request_rate(self) -> float | None: ...
    @property
    def panic_counted_s(self) -> float | None: ...


class LoopState(Protocol):
    """What the load remembers between ticks (:class:`controlplane.autoscale.decide.LoopState` has it)."""

    @property
    def load(self) -> tuple[LoadSample, ...]: ...

# A steady Poisson load reads as a change of load (steady_load) this often, from its counting noise alone.
# Each false change costs a few minutes of the fleet sized on one noisy window; a smaller rate delays the
# detection of a real change of a few standard errors until the steady mean or trend follows it.
FALSE_CHANGES_PER_DAY = 1.0
DAY_S = 86_400.0
# After a change, each window's own rate stands for this many windows' time: the level then counts that
# many windows of arrivals after the change, half as noisy as one window.
YOUNG = 4


@dataclass(slots=True, frozen=True)
class LoadSample:
    """One tick's offered load, kept for the steady load (:func:`steady_load`)."""

    at: float
    rate: float
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    change: bool = False  # the load changed at this tick: the windows before it are not the load's


@dataclass(slots=True, frozen=True)
class SteadyLoad:
    """The load the work is sized on (:func:`steady_load`): the level of the ticks since the load last
    changed, at most the stabilization window, or this tick's own, with the note that says which."""

    rate: float | None
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    changed: bool  # this tick's rate is a change: the samples before it are dropped
    note: str


def steady_load(obs: Observation, state: LoopState, cfg: AutoscalerConfig) -> SteadyLoad:
    """The offered load to size the fleet on. A rate over a short window carries its counting noise
    (about +-8% at 5 requests/s over 30 s), and the scale-down stabilization keeps the highest
    recommendation of its window, so a fleet sized on each window's rate is sized on the noisiest reading
    of the last five minutes. Instead: the level of the ticks' rates since the load last changed, over the
    stabilization window at most (:func:`_level`: their mean, or their trend when they have one beyond
    noise), with their requests' mean sizes weighted by rate. A window's rate further from that level than
    :func:`change_z` Poisson standard errors, ``sqrt(level / window)``, is a change, taken at once; each
    window's own rate then stands for ``YOUNG`` windows' time, and the level starts again from the windows
    that lie wholly after the change. Arrivals burstier than Poisson read as changes more often, which
    falls back to each window's own rate; so does a window over the level while the fleet shows it short
    (queue and P95 TTFT over their targets). This tick's own load without a rate window or earlier ticks."""
    rate, prompt, output, window = obs.request_rate, obs.mean_prompt_tokens, obs.mean_output_tokens, \
        obs.rate_window_s
    samples = [s for s in state.load if obs.now - s.at <= cfg.scale_down_stabilization_s]
    if rate is None or not window or not samples:
        return SteadyLoad(rate, prompt, output, changed=rate is not None, note="")
    start = samples[0]
    if start.change and obs.now - start.at < YOUNG * window:
        return SteadyLoad(rate, prompt, output, changed=False,
                          note=f"the load changed {obs.now - start.at:.0f}s ago: this window's {rate:.3g} "
                               f"req/s until {YOUNG} windows' time after it")
    ticks = [s for s in samples if not start.change or s.at >= start.at + window]
    ticks.append(LoadSample(obs.now, rate, prompt, output))
    z, fit = change_z(window), _level(ticks, window)
    error = math.sqrt(max(fit.window, 1.0 / window) / window)
    span = f"{len(ticks)} ticks over {obs.now - ticks[0].at:.0f}s"
    if abs(rate - fit.window) > z * error:
        return SteadyLoad(rate, prompt, output, changed=True,
                          note=f"load changed: {rate:.3g} req/s against {fit.window:.3g} from the last "
                               f"{span} ({abs(rate - fit.window) / error:.1f} standard errors, over {z:.2f})")
    if rate > fit.now and (stressed := _stressed(obs, cfg)):
        return SteadyLoad(rate, prompt, output, changed=False,
                          note=f"this window's {rate:.3g} req/s over the steady {fit.now:.3g} while "
                               f"{stressed}: taken as load, not noise")
    how = f"the trend of {span} ({fit.slope * 60:+.3g} req/s a minute)" if fit.trend else \
        f"the mean of {span}"
    return SteadyLoad(max(fit.now, 0.0),
                      _weighted(ticks, "mean_prompt_tokens") if prompt is not None else None,
                      _weighted(ticks, "mean_output_tokens") if output is not None else None, changed=False,
                      note=f"steady load: {fit.now:.3g} req/s, {how} (this window's {rate:.3g} within "
                           f"{z:.2f} standard errors)")


def change_z(window_s: float) -> float:
    """Standard errors beyond which a window's rate is a change: the two-sided normal quantile at which a
    steady Poisson load, read in disjoint windows of ``window_s``, reads as one ``FALSE_CHANGES_PER_DAY``
    times a day (3.58 for 30 s windows)."""
    windows_per_day = max(DAY_S / window_s, FALSE_CHANGES_PER_DAY)  # a day-long window: every one a change
    return NormalDist().inv_cdf(1 - FALSE_CHANGES_PER_DAY / (2 * windows_per_day))


@dataclass(slots=True, frozen=True)
class _Level:
    window: float  # what the fit expects of the last tick's window
    now: float  # the rate it gives for now
    slope: float  # requests/s per second (0 without a trend)
    trend: bool


def _level(ticks: list[LoadSample], window_s: float) -> _Level:
    """The load's level from the ticks' window rates: their mean, or their least-squares line when its
    slope is further than :func:`change_z` standard errors from flat. Under Poisson arrivals at rate r over a
    span T of arrivals (the ticks' spread plus one window), the slope's standard error is sqrt(12 r / T^3).
    A window's rate is the mean over the window before its tick: the line gives the rate at the window's
    middle, and now is half a window further."""
    n = len(ticks)
    mean = sum(s.rate for s in ticks) / n
    mid = sum(s.at for s in ticks) / n
    spread = sum((s.at - mid) ** 2 for s in ticks)
    if n < 3 or spread <= 0:
        return _Level(mean, mean, 0.0, False)
    slope = sum((s.at - mid) * (s.rate - mean) for s in ticks) / spread
    span = ticks[-1].at - ticks[0].at + window_s
    error = math.sqrt(12 * max(mean, 1.0 / window_s) / span**3)
    if abs(slope) <= change_z(window_s) * error:
        return _Level(mean, mean, 0.0, False)
    last = mean + slope * (ticks[-1].at - mid)
    return _Level(last, last + slope * window_s / 2, slope, True)


def _stressed(obs: Observation, cfg: AutoscalerConfig) -> str:
    """What shows the fleet short of capacity now, or "": its queue over the target and P95 TTFT over the
    SLO, both beyond the tolerance (then the window's rate is not read as noise; the backlog proposal,
    which adds a replica, asks less of the queue: that it grows)."""
    limit = 1 + cfg.tolerance
    waiting, ttft = obs.metrics.get("waiting_per_replica"), obs.metrics.get("ttft_p95_s")
    if waiting is None or ttft is None or waiting <= cfg.target_waiting_per_replica * limit \
            or ttft <= cfg.ttft_slo_s * limit:
        return ""
    return f"{waiting:.3g} waiting per replica and P95 TTFT {ttft:.2f}s"


def _weighted(ticks: list[LoadSample], field_name: str) -> float | None:
    pairs = [(s.rate, v) for s in ticks if (v := getattr(s, field_name)) is not None and s.rate > 0]
    total = sum(w for w, _ in pairs)
    return sum(w * v for w, v in pairs) / total if total > 0 else None


def surge(obs: Observation, level: float | None, cfg: AutoscalerConfig) -> tuple[float, str] | None:
    """The panic window's rate and why it is a surge, or None. A surge is a count of arrivals over the
    last ``panic_window_s`` that a Poisson count at the steady ``level`` reaches in at most
    ``FALSE_CHANGES_PER_DAY`` such windows a day, by the exact Poisson tail (at the dozen or two arrivals
    of a 6 s window the normal approximation of :func:`change_z` reads noise as a change several times as
    often). A burst shows there up to a metrics window before that window's rate does. The count is of
    the arrivals the rate was measured from (``obs.panic_counted_s``): an extrapolated rate read as a
    count over the whole window would be noisier than a Poisson count of that size."""
    short, span = obs.panic_request_rate, cfg.panic_window_s
    if short is None or level is None or span <= 0:
        return None
    counted = obs.panic_counted_s or span
    expected, seen = level * counted, round(short * counted)
    if seen <= expected:
        return None
    chance = poisson_at_least(seen, expected)
    allowed = FALSE_CHANGES_PER_DAY / max(DAY_S / span, FALSE_CHANGES_PER_DAY)
    if chance > allowed:
        return None
    return short, (f"load surged: {short:.3g} req/s over the last {span:g}s against the steady {level:.3g} "
                   f"(a Poisson count this high: P {chance:.1e}, at most {allowed:.1e}, about one false "
                   f"surge a day)")


def load_after(obs: Observation, state: LoopState, cfg: AutoscalerConfig) -> tuple[LoadSample, ...]:
    """The load samples after this tick (:func:`remember`)."""
    if obs.request_rate is None:
        return state.load
    return remember(state.load, LoadSample(obs.now, obs.request_rate, obs.mean_prompt_tokens,
                                           obs.mean_output_tokens),
                    changed=steady_load(obs, state, cfg).changed, window_s=obs.rate_window_s,
                    keep_s=cfg.scale_down_stabilization_s)


def remember(load: tuple[LoadSample, ...], sample: LoadSample, *, changed: bool, window_s: float | None,
             keep_s: float) -> tuple[LoadSample, ...]:
    """The load samples once ``sample`` (a tick's, ``changed``: its rate is a change of load) is added:
    at a change, only it (marked a change when there were samples before it); otherwise those within
    ``keep_s`` (the stabilization window) and it, except that a window that straddles the last change is
    not kept. What each tick's decision record keeps (``request_rate``, the means, ``rate_window_s``,
    ``load_changed``) rebuilds it tick by tick."""
    if changed:
        return (replace(sample, change=bool(load)),)
    kept = tuple(s for s in load if sample.at - s.at <= keep_s)
    if kept and kept[0].change and window_s and sample.at - kept[0].at < window_s:
        return kept  # this window still counts arrivals from before the change
    return (*kept, sample)
