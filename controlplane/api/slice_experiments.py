"""The slice-experiment endpoints of the REST API (``/api/v1/experiments/slices``): chaos on a coloured share
of real traffic against a same-size control colour, measured live, stopping itself on the deviation
(:mod:`controlplane.rollouts.experiment`).

``POST`` starts one (operator; 409 while one runs or the traffic carries colours already, 400 for a body
the run cannot take, ``param`` naming the field); ``GET`` lists them and shows one (viewer); ``POST
.../{id}/abort`` stops one early (operator), its fault reverted and its colours cleared. Every answer has a
declared schema; start and abort are audited, also when refused.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from chaos.faults.base import FaultError
from controlplane.api.errors import field_of
from controlplane.api.guards import require
from controlplane.auth import Auditor, Principal, Role
from controlplane.errors import Conflict, NotFound, Refused
from controlplane.rollouts.experiment import KEEP_RECORDS, Bounds, ExperimentSpec, SliceExperiments

COLOUR = r"^[a-z0-9][a-z0-9-]{0,31}$"


# ---- the request ---------------------------------------------------------------------------------
class BoundsBody(BaseModel):
    """When the run stops itself: the experiment slice beyond these against the control, significantly."""

    model_config = ConfigDict(extra="forbid")

    max_error_increase: float = Field(default=0.05, ge=0, lt=1, description="failure share above the "
                                      "control's (absolute, 0..1) beyond which the run stops")
    max_latency_ratio: float = Field(default=1.5, ge=1, le=1000, description="median TTFT (and TPOT) over "
                                     "the control's beyond which the run stops")
    alpha: float = Field(default=0.01, gt=0, lt=0.5, description="significance of each one-sided test")
    min_samples: int = Field(default=10, ge=5, le=1_000_000,
                             description="requests per side before a decision")


class StartSliceExperiment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    share: float = Field(gt=0, le=0.5, description="share of all requests in each colour (experiment and "
                                                   "control: two slices of this size)")
    fault: Literal["error_rate", "token_latency", "prefill_delay"] = Field(
        description="a coloured replica fault; it touches only the experiment colour's requests")
    params: dict[str, float | int | str | bool] = Field(default_factory=dict, description="the fault's "
                                                        "parameters (error_rate: probability, status_code; "
                                                        "the delays: seconds); colour is set by the run")
    duration_s: float = Field(60.0, gt=0, le=3600, description="the longest the run lasts")
    check_interval_s: float = Field(1.0, ge=0.1, le=60, description="seconds between two comparisons")
    bounds: BoundsBody = BoundsBody()
    colour: str = Field("chaos", pattern=COLOUR, description="the experiment colour")
    control: str = Field("control", pattern=COLOUR, description="the control colour")

    def spec(self) -> ExperimentSpec:
        """ValueError naming the field for what the run cannot take."""
        return ExperimentSpec(share=self.share, fault=self.fault, params=dict(self.params),
                              duration_s=self.duration_s, check_interval_s=self.check_interval_s,
                              bounds=Bounds(**self.bounds.model_dump()), colour=self.colour,
                              control=self.control)


# ---- the answers ---------------------------------------------------------------------------------
class SideCounts(BaseModel):
    requests: int
    failed: int


class MetricFigures(BaseModel):
    """One metric of one side: its requests and failures, and P50/P95/P99 in milliseconds (None for the
    errors metric, or without successful requests)."""

    requests: int
    failed: int
    error_rate: float
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


class SideReport(SideCounts):
    metrics: dict[str, MetricFigures] = Field(default_factory=dict, description="errors, ttft, tpot")


class Difference(BaseModel):
    """Experiment minus control, with its two-sided interval."""

    metric: str = Field(description="error_rate (share), ttft_p50_s or tpot_p50_s (seconds)")
    estimate: float
    low: float
    high: float
    confidence: float
    method: str
    excludes_zero: bool


class SliceReport(BaseModel):
    experiment: SideReport
    control: SideReport
    uncoloured: SideCounts = Field(description="requests in neither colour; the fault must not reach them")
    analysis: dict[str, Any] = Field(description="the verdict, its reasons and each metric's test "
                                                 "(controlplane.rollouts.analysis)")
    differences: list[Difference]


class Check(BaseModel):
    t: float = Field(description="seconds after the colours went on")
    verdict: str = Field(description="pass, fail or inconclusive")
    reasons: list[str] = Field(default_factory=list)
    experiment: SideCounts
    control: SideCounts
    uncoloured: SideCounts


class Stopped(BaseModel):
    reason: Literal["deviation", "duration", "abort", "halted", "error", "interrupted"]
    detail: str = ""
    after_s: float | None = Field(None, description="seconds after the colours went on")


class RevertOutcome(BaseModel):
    fault_id: int
    ok: bool
    detail: str = ""


class SliceSpec(BaseModel):
    share: float
    fault: str
    params: dict[str, float | int | str | bool] = Field(default_factory=dict)
    duration_s: float
    check_interval_s: float
    bounds: BoundsBody
    colour: str
    control: str


Status = Literal["running", "deviated", "completed", "aborted", "failed", "interrupted"]


class SliceExperiment(BaseModel):
    """A run: while it runs, its checks so far; at the end its report and why it stopped."""

    id: int
    status: Status
    by: str = ""
    spec: SliceSpec
    started_at: float
    coloured_at: float | None = Field(None, description="when the colours went on, after the fault")
    finished_at: float | None = None
    fault_ids: list[int] = Field(default_factory=list)
    fault_targets: list[str] = Field(default_factory=list)
    checks: list[Check] = Field(default_factory=list)
    report: SliceReport | None = None
    stopped: Stopped | None = None
    faults_reverted: bool | None = None
    colours_cleared: bool | None = None
    reverts: list[RevertOutcome] = Field(default_factory=list)
    error: str | None = None


class SliceExperimentSummary(BaseModel):
    id: int
    status: Status
    by: str = ""
    fault: str
    share: float
    started_at: float
    finished_at: float | None = None
    stopped: Stopped | None = None
    experiment: SideCounts | None = None
    control: SideCounts | None = None
    uncoloured: SideCounts | None = None


class SliceExperimentStarted(BaseModel):
    id: int
    status: Status


class SliceExperimentAbort(BaseModel):
    id: int
    aborting: bool


# ---- the routes ----------------------------------------------------------------------------------
def slice_experiments_router(experiments: SliceExperiments, auditor: Auditor) -> APIRouter:
    router = APIRouter(prefix="/api/v1/experiments/slices", tags=["experiments"])
    viewer, operator = require(Role.VIEWER), require(Role.OPERATOR)

    @router.post("", status_code=202)
    async def start(body: StartSliceExperiment, who: Principal = Depends(operator)) -> SliceExperimentStarted:
        """Colour two slices of ``share``, put the fault on the experiment colour, compare it with the control
        every ``check_interval_s`` and stop on a deviation beyond ``bounds`` (or at ``duration_s``)."""
        params = body.model_dump()
        try:
            experiment_id = experiments.start(body.spec(), who.name)
        except (ValueError, KeyError) as exc:
            message = str(exc).strip("'\"")
            auditor.record(who, "experiment.slice.start", body.fault, params, "error", message)
            raise Refused(message, param=field_of(message)) from exc
        except (Conflict, FaultError) as exc:
            auditor.record(who, "experiment.slice.start", body.fault, params, "denied", str(exc))
            raise
        auditor.record(who, "experiment.slice.start", body.fault, params, "ok",
                       f"slice experiment {experiment_id}")
        return SliceExperimentStarted(id=experiment_id, status="running")

    @router.get("")
    async def listing(limit: int = Query(50, ge=1, le=KEEP_RECORDS),
                      _: Principal = Depends(viewer)) -> list[SliceExperimentSummary]:
        return [_summary(r) for r in experiments.recent(limit)]

    @router.get("/{experiment_id}")
    async def show(experiment_id: int, _: Principal = Depends(viewer)) -> SliceExperiment:
        return SliceExperiment.model_validate(_record(experiments, experiment_id))

    @router.post("/{experiment_id}/abort")
    async def abort(experiment_id: int, who: Principal = Depends(operator)) -> SliceExperimentAbort:
        record = _record(experiments, experiment_id)
        if not experiments.abort(experiment_id):
            auditor.record(who, "experiment.slice.abort", str(experiment_id), {}, "denied", "not running")
            raise Conflict(f"slice experiment {experiment_id} is not running (status {record.get('status')})",
                           subject=str(experiment_id))
        auditor.record(who, "experiment.slice.abort", str(experiment_id), {}, "ok")
        return SliceExperimentAbort(id=experiment_id, aborting=True)

    return router


def _record(experiments: SliceExperiments, experiment_id: int) -> dict[str, Any]:
    record = experiments.get(experiment_id)
    if record is None:
        raise NotFound(f"no slice experiment {experiment_id}", subject=str(experiment_id))
    return record


def _summary(record: dict[str, Any]) -> SliceExperimentSummary:
    spec, report = record.get("spec") or {}, record.get("report") or {}
    latest = (record.get("checks") or [{}])[-1]
    sides = {name: report.get(name) or latest.get(name) for name in ("experiment", "control", "uncoloured")}
    return SliceExperimentSummary.model_validate({
        "id": record["id"], "status": record["status"], "by": record.get("by", ""),
        "fault": spec.get("fault", ""), "share": spec.get("share", 0.0), "started_at": record["started_at"],
        "finished_at": record.get("finished_at"), "stopped": record.get("stopped"),
        **{name: None if side is None else {"requests": side["requests"], "failed": side["failed"]}
           for name, side in sides.items()}})
