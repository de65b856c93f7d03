"""What the REST API answers, as typed values: the records :class:`controlplane.client.ControlPlaneClient`
returns to the CLI and the console (which read attributes, never JSON keys).

Where it sits: below the client (and its plumbing, :mod:`controlplane.connection`), which re-exports the
records: the console imports them through it. Above only the error tree. One module per area of the API
(``fleet``, ``observability``, ``access``, ``chaos``, ``autoscaler``, ``alerts``, ``drills``,
``schedules``, ``simulations``, ``experiments``), and the generic decoder (:mod:`controlplane.views.decoder`).

Each record is a frozen dataclass whose fields are named as the API's JSON keys; :func:`decode` builds one
from an answer, checking every field's type and ignoring keys it does not know (so an older console keeps
working against a newer control plane). A few nested parts stay mappings inside a typed record because
their keys are open-ended by design: a drill report's ``figures`` and ``timeline`` (they grow with the
drill figures, and the report module renders them by name), an event's ``detail`` and an audit record's
``params`` (one shape per action), a schedule's ``overrides`` (any scenario override), an experiment's
journal (the Chaos Toolkit journal format). :func:`as_json` turns records back into plain JSON values
(``--json`` output of the CLI).
"""

from controlplane.views.access import AuditEntry, Login
from controlplane.views.alerts import ActiveAlert, AlertAction, AlertRule, AlertTransition, RuleSwitch
from controlplane.views.autoscaler import (
    ActiveWindow,
    AutoscalerPolicy,
    AutoscalerStatus,
    Decision,
    DecisionInputs,
    Proposal,
    ScheduleWindow,
    Windows,
)
from controlplane.views.chaos import (
    ActiveFault,
    BlastRadius,
    Experiment,
    ExperimentStarted,
    ExperimentSummary,
    FaultKind,
    FaultParam,
    Halt,
    HaltState,
    Injection,
    Revert,
)
from controlplane.views.decoder import UnexpectedAnswer, as_json, decode, decode_list
from controlplane.views.drills import (
    Aim,
    ComparedDrill,
    ComparedFigure,
    DrillAbort,
    DrillCheck,
    DrillComparison,
    DrillPlan,
    DrillProgress,
    DrillReport,
    DrillStarted,
    DrillSummary,
    PlannedFault,
    Scenario,
    ScenarioFault,
)
from controlplane.views.experiments import (
    SliceBounds,
    SliceCheck,
    SliceCounts,
    SliceDifference,
    SliceExperiment,
    SliceExperimentAbort,
    SliceExperimentStarted,
    SliceExperimentSummary,
    SliceMetricFigures,
    SliceReport,
    SliceRevert,
    SliceSide,
    SliceSpec,
    SliceStop,
)
from controlplane.views.fleet import FleetView, GatewayView, NodeView, ReplicaView, RolloutView
from controlplane.views.observability import (
    Event,
    ExpertLoad,
    LatencyBreakdown,
    MetricSummary,
    Quantiles,
    ReplicaActivity,
    ReplicaExpertLoad,
    ReplicaTail,
    Series,
    StageMeans,
    Trace,
)
from controlplane.views.schedules import DrillSchedule, ScheduleRun, schedule_aim_and_load
from controlplane.views.simulations import (
    PolicyOutcome,
    SimSlo,
    SimTimeline,
    SimulationJob,
    SimulationProgress,
    SimulationResult,
)

__all__ = [
    "ActiveAlert", "ActiveFault", "ActiveWindow", "Aim", "AlertAction", "AlertRule", "AlertTransition",
    "AuditEntry", "AutoscalerPolicy", "AutoscalerStatus", "BlastRadius", "ComparedDrill", "ComparedFigure",
    "Decision", "DecisionInputs", "DrillAbort", "DrillCheck", "DrillComparison", "DrillPlan", "DrillProgress",
    "DrillReport", "DrillSchedule", "DrillStarted", "DrillSummary", "Event", "Experiment",
    "ExperimentStarted", "ExperimentSummary", "ExpertLoad", "FaultKind", "FaultParam", "FleetView",
    "GatewayView", "Halt", "HaltState", "Injection", "LatencyBreakdown", "Login", "MetricSummary", "NodeView",
    "PlannedFault", "PolicyOutcome", "Proposal", "Quantiles", "ReplicaActivity", "ReplicaExpertLoad",
    "ReplicaTail", "ReplicaView", "Revert", "RolloutView", "RuleSwitch", "Scenario", "ScenarioFault",
    "ScheduleRun", "ScheduleWindow", "Series", "SimSlo", "SimTimeline", "SimulationJob", "SimulationProgress",
    "SimulationResult", "SliceBounds", "SliceCheck", "SliceCounts", "SliceDifference", "SliceExperiment",
    "SliceExperimentAbort", "SliceExperimentStarted", "SliceExperimentSummary", "SliceMetricFigures",
    "SliceReport", "SliceRevert", "SliceSide", "SliceSpec", "SliceStop", "StageMeans", "Trace",
    "UnexpectedAnswer", "Windows", "as_json", "decode", "decode_list", "schedule_aim_and_load",
]
