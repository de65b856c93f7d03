"""The autoscaler's anomaly source: demand or latency that the season does not explain.

Each tick brings one point (request rate, P95 TTFT). STL (statsmodels, robust) splits the bounded history
before it into trend, season and residual; the point's residual is what is left after the latest trend
and the season one period ago. An IsolationForest (scikit-learn), refit every few ticks on the residuals
of earlier normal points, scores it. A point is anomalous when the forest isolates it and one of its
residuals is also above ``z`` robust standard deviations upwards (only more demand or slower first
tokens call for replicas). An anomalous point enters the history as its expected value, so a burst does
not teach the fit that bursts are normal (unless it lasts a whole period: then it is the new normal).
Three anomalous points in a row propose +1 replica, five propose +2; once it fired, the source waits
out its own cooldown before a new episode may fire again.

Pure bookkeeping with numerical libraries: no I/O and no clock (time comes in with each point), and
:func:`observe` returns the next :class:`AnomalyState` instead of changing the one it was given.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from controlplane.autoscale.policies import Proposal

if TYPE_CHECKING:  # scikit-learn and statsmodels are imported where first used: 1.4 s of a start
    from sklearn.ensemble import IsolationForest  # type: ignore[import-untyped]

STEPS = ((5, 2), (3, 1))  # (consecutive anomalous points, replicas added), largest first
_MAD_TO_SIGMA = 1.4826


@dataclass(slots=True, frozen=True)
class AnomalySettings:
    period: int = 12
    history: int = 120
    refit_every: int = 12
    z: float = 3.0
    cooldown_s: float = 300.0
    # Scale floors: below these a residual is noise whatever the history says (an idle fleet's first
    # request is not an anomaly).
    min_rate_sigma: float = 0.2  # requests/s
    min_ttft_sigma_s: float = 0.05
    trees: int = 50  # enough for two residual features; the fit stays well under a tick
    seed: int = 0

    def __post_init__(self) -> None:
        if self.period < 2 or self.history < 3 * self.period:
            raise ValueError(f"period/history: need period >= 2 and history >= 3 periods, got "
                             f"{self.period}/{self.history}")
        if self.refit_every < 1 or self.z <= 0 or self.cooldown_s <= 0:
            raise ValueError("refit_every >= 1, z > 0 and cooldown_s > 0 required")
        if self.min_rate_sigma <= 0 or self.min_ttft_sigma_s <= 0:
            raise ValueError("min_rate_sigma and min_ttft_sigma_s: must be > 0")


@dataclass(slots=True, frozen=True)
class AnomalyReading:
    """What the source saw at one tick; stored in the decision record."""

    points: int
    anomalous: bool
    consecutive: int
    residual_rate: float | None = None  # request rate minus trend and season (requests/s)
    residual_ttft_s: float | None = None
    z_rate: float | None = None  # residual over its robust standard deviation
    z_ttft: float | None = None
    score: float | None = None  # IsolationForest score_samples: lower is more anomalous
    threshold: float | None = None  # the forest's offset: scores below it are outliers
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


@dataclass(slots=True, frozen=True)
class AnomalyState:
    """What the source remembers between ticks. Each tick makes a new one (:func:`observe`).

    Frozen, but for one object: the fitted IsolationForest (scikit-learn models are mutable objects). It is
    never changed once fitted; a refit makes a new forest, so states that share one stay independent.
    """

    settings: AnomalySettings = AnomalySettings()
    rates: tuple[float, ...] = ()  # the last ``settings.history`` points, oldest first
    ttfts: tuple[float, ...] = ()
    errors: tuple[tuple[float, float], ...] = ()  # one-step forecast residuals of normal points
    ttft_seen: bool = False
    consecutive: int = 0
    episode_base: int | None = None  # replicas when the current episode's first point came
    fired_step: int = 0  # replicas the current episode added
    last_fired_at: float | None = None
    ticks_since_fit: int = 0
    forest: IsolationForest | None = None
    scale: tuple[float, float] = (1.0, 1.0)  # residual scales the forest was fitted with


Outcome = tuple[Proposal | None, AnomalyReading, AnomalyState]


def observe(state: AnomalyState, now: float, current: int, rate: float | None,
            ttft_p95_s: float | None) -> Outcome:
    """Add one point: whether the source proposes replicas now, what it saw, and the state after it.
    ``ttft_p95_s`` None: no request in the window (the last known latency carries on)."""
    period = state.settings.period
    ttft = ttft_p95_s if ttft_p95_s is not None and math.isfinite(ttft_p95_s) else None
    if ttft is not None and not state.ttft_seen:  # until the first request, latency is unknown: backfill
        state = replace(state, ttfts=(ttft,) * len(state.ttfts), ttft_seen=True)
    last_ttft = state.ttfts[-1] if state.ttfts else 0.0
    point = (0.0 if rate is None or not math.isfinite(rate) else rate, last_ttft if ttft is None else ttft)
    if len(state.rates) < 3 * period:
        state = _appended(state, point)
        note = f"warming up ({len(state.rates)}/{3 * period} points)"
        return None, AnomalyReading(len(state.rates), False, 0, note=note), state
    reading, expected, state = _score(state, point)
    consecutive = state.consecutive + 1 if reading.anomalous else 0
    # An anomalous point enters the history as what was expected, so that the fit keeps describing
    # normal load; a shift that lasts a whole period is the new normal and enters as it is.
    kept = expected if reading.anomalous and consecutive < period else point
    state = replace(_appended(state, kept), consecutive=consecutive)
    reading = _with(reading, consecutive=consecutive)
    if not reading.anomalous:
        return None, reading, replace(state, episode_base=None, fired_step=0)
    base = current if state.episode_base is None else state.episode_base
    return _propose(replace(state, episode_base=base), base, now, reading)


def _appended(state: AnomalyState, point: tuple[float, float]) -> AnomalyState:
    keep = state.settings.history
    return replace(state, rates=(*state.rates, point[0])[-keep:], ttfts=(*state.ttfts, point[1])[-keep:])


def _propose(state: AnomalyState, base: int, now: float, reading: AnomalyReading) -> Outcome:
    step = next((add for count, add in STEPS if state.consecutive >= count), 0)
    if step == 0:
        return None, reading, state
    if step > state.fired_step:  # a new step fires unless a finished episode's cooldown still runs
        last = state.last_fired_at
        if state.fired_step == 0 and last is not None and now - last < state.settings.cooldown_s:
            left = state.settings.cooldown_s - (now - last)
            return None, _with(reading, note=f"anomalous, but in cooldown for {left:.0f}s more"), state
        state = replace(state, fired_step=step, last_fired_at=now)
    wanted = base + state.fired_step
    reason = (f"{state.consecutive} anomalous points in a row "
              f"(residual rate {reading.residual_rate:+.3g}/s z={reading.z_rate:.1f}, "
              f"ttft {reading.residual_ttft_s:+.3g}s z={reading.z_ttft:.1f}, "
              f"forest score {reading.score:.3f} vs {reading.threshold:.3f}): "
              f"{base} + {state.fired_step} = {wanted}")
    return Proposal("anomaly", wanted, reason), reading, state


def _score(state: AnomalyState,
           point: tuple[float, float]) -> tuple[AnomalyReading, tuple[float, float], AnomalyState]:
    """The point's residual against the fit of the history before it (trend now + the season one
    period ago), scored against earlier such residuals by their robust scale and an IsolationForest."""
    settings, period = state.settings, state.settings.period
    fits = [_decompose(np.asarray(s, dtype=float), period) for s in (state.rates, state.ttfts)]
    expected = (float(fits[0][0][-1] + fits[0][1][-period]), float(fits[1][0][-1] + fits[1][1][-period]))
    newest = np.asarray(point) - np.asarray(expected)
    residual = (float(newest[0]), float(newest[1]))
    if len(state.errors) < 2 * period:  # the forecast errors of normal load are not known yet
        state = _with_error(state, residual)
        note = f"calibrating ({len(state.errors)}/{2 * period} residuals)"
        return AnomalyReading(len(state.rates) + 1, False, 0, *residual, note=note), expected, state
    errors = np.asarray(state.errors)
    scales = (max(_robust_sigma(errors[:, 0]), settings.min_rate_sigma),
              max(_robust_sigma(errors[:, 1]), settings.min_ttft_sigma_s))
    forest, scale, ticks = state.forest, state.scale, state.ticks_since_fit
    if forest is None or ticks >= settings.refit_every:
        from sklearn.ensemble import IsolationForest

        forest = IsolationForest(n_estimators=settings.trees, contamination="auto",
                                 random_state=settings.seed)
        forest.fit(errors / np.asarray(scales))
        scale, ticks = scales, 0
    state = replace(state, forest=forest, scale=scale, ticks_since_fit=ticks + 1)
    score = float(forest.score_samples((newest / np.asarray(scale)).reshape(1, -1))[0])
    threshold = float(forest.offset_)
    z_rate, z_ttft = residual[0] / scales[0], residual[1] / scales[1]
    # Residuals without any spread (an idle fleet) give the forest nothing to isolate: z alone decides.
    flat = bool(np.all(np.ptp(errors, axis=0) == 0))
    anomalous = (flat or score < threshold) and max(z_rate, z_ttft) >= settings.z
    reading = AnomalyReading(len(state.rates) + 1, anomalous, 0, *residual, z_rate, z_ttft, score, threshold,
                             note="no spread in earlier residuals: z alone decides" if flat else "")
    if not anomalous or state.consecutive + 1 >= period:  # the residuals of normal load, and a new normal
        state = _with_error(state, residual)
    return reading, expected, state


def _with_error(state: AnomalyState, residual: tuple[float, float]) -> AnomalyState:
    return replace(state, errors=(*state.errors, residual)[-state.settings.history:])


def _decompose(series: np.ndarray, period: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trend, season and residual of a robust STL fit."""
    if float(np.ptp(series)) == 0.0:  # a flat series has nothing to decompose (and STL divides by it)
        zeros = np.zeros_like(series)
        return series.copy(), zeros, zeros
    from statsmodels.tsa.seasonal import STL  # type: ignore[import-untyped]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = STL(series, period=period, robust=True).fit()
    return (np.asarray(fit.trend, dtype=float), np.asarray(fit.seasonal, dtype=float),
            np.asarray(fit.resid, dtype=float))


def _robust_sigma(values: np.ndarray) -> float:
    """Median absolute deviation as a standard deviation."""
    return float(np.median(np.abs(values - np.median(values)))) * _MAD_TO_SIGMA


def _with(reading: AnomalyReading, **changes: Any) -> AnomalyReading:
    return dataclasses.replace(reading, **changes)
