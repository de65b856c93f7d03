"""Slice experiments as the API shows them (``/api/v1/experiments/slices``): chaos on a coloured share of
traffic against a same-size control colour, its checks as it runs, and its report (both sides' figures,
each difference with its interval, the uncoloured requests, why it stopped). Part of
:mod:`controlplane.views`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.views.decoder import DOCUMENT, Scalar


@dataclass(slots=True, frozen=True)
class SliceCounts:
    requests: int
    failed: int


@dataclass(slots=True, frozen=True)
class SliceMetricFigures:
    """One metric (errors, ttft, tpot) of one side; P50/P95/P99 in milliseconds."""

    requests: int
    failed: int
    error_rate: float
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


@dataclass(slots=True, frozen=True)
class SliceSide:
    requests: int
    failed: int
    metrics: Mapping[str, SliceMetricFigures] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class SliceDifference:
    """Experiment minus control (``metric``: error_rate as a share, ttft_p50_s / tpot_p50_s in seconds),
    with its two-sided ``confidence`` interval [low, high]."""

    metric: str
    estimate: float
    low: float
    high: float
    confidence: float
    method: str
    excludes_zero: bool


@dataclass(slots=True, frozen=True)
class SliceReport:
    """``analysis`` stays a mapping: the verdict, its reasons and each metric's test, as
    :mod:`controlplane.rollouts.analysis` writes them."""

    experiment: SliceSide
    control: SliceSide
    uncoloured: SliceCounts
    differences: tuple[SliceDifference, ...] = ()
    analysis: Mapping[str, Any] = field(default_factory=dict)

    def difference(self, metric: str) -> SliceDifference | None:
        return next((d for d in self.differences if d.metric == metric), None)


@dataclass(slots=True, frozen=True)
class SliceCheck:
    t: float  # seconds after the colours went on
    verdict: str  # pass | fail | inconclusive
    experiment: SliceCounts
    control: SliceCounts
    uncoloured: SliceCounts
    reasons: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class SliceStop:
    reason: str  # deviation | duration | abort | halted | error | interrupted
    detail: str = ""
    after_s: float | None = None


@dataclass(slots=True, frozen=True)
class SliceBounds:
    max_error_increase: float
    max_latency_ratio: float
    alpha: float
    min_samples: int


@dataclass(slots=True, frozen=True)
class SliceSpec:
    share: float
    fault: str
    duration_s: float
    check_interval_s: float
    bounds: SliceBounds
    colour: str
    control: str
    params: Mapping[str, Scalar] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class SliceRevert:
    fault_id: int
    ok: bool
    detail: str = ""


@dataclass(slots=True, frozen=True)
class SliceExperiment:
    """One run; ``document`` is the whole record as stored."""

    id: int
    status: str  # running | deviated | completed | aborted | failed | interrupted
    spec: SliceSpec
    started_at: float
    by: str = ""
    coloured_at: float | None = None  # when the colours went on (after the fault); ``t`` counts from it
    finished_at: float | None = None
    fault_ids: tuple[int, ...] = ()
    fault_targets: tuple[str, ...] = ()
    checks: tuple[SliceCheck, ...] = ()
    report: SliceReport | None = None
    stopped: SliceStop | None = None
    faults_reverted: bool | None = None
    colours_cleared: bool | None = None
    reverts: tuple[SliceRevert, ...] = ()
    error: str | None = None
    document: Mapping[str, Any] = field(default_factory=dict, metadata=DOCUMENT)

    @property
    def finished(self) -> bool:
        return self.status != "running"


@dataclass(slots=True, frozen=True)
class SliceExperimentSummary:
    id: int
    status: str
    fault: str
    share: float
    started_at: float
    by: str = ""
    finished_at: float | None = None
    stopped: SliceStop | None = None
    experiment: SliceCounts | None = None
    control: SliceCounts | None = None
    uncoloured: SliceCounts | None = None


@dataclass(slots=True, frozen=True)
class SliceExperimentStarted:
    id: int
    status: str


@dataclass(slots=True, frozen=True)
class SliceExperimentAbort:
    id: int
    aborting: bool
