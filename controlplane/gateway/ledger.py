"""What the gateway keeps of each finished request: its metrics, its outcome in its traffic slices, its trace.

:meth:`Ledger.finish` runs once per request however it ended (answered, refused, failed mid-stream, the
client gone); the trace goes to ``on_trace`` (the reports buffer of a gateway process, which delivers it to
the control plane) and the outcome to :class:`controlplane.gateway.slices.SliceSamples`, which the control
plane reads to compare a canary or an experiment slice with its baseline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.request import Job, job_trace, stage_seconds
from controlplane.gateway.slices import Outcome, SliceSamples
from controlplane.gateway.tracing import CLIENT_DISCONNECTED
from controlplane.traces import TraceRecord

logger = logging.getLogger(__name__)


class Ledger:
    def __init__(self, metrics: GatewayMetrics, on_trace: Callable[[TraceRecord], None],
                 clock: Callable[[], float]) -> None:
        self.metrics = metrics
        self.on_trace = on_trace
        self.clock = clock
        self.samples = SliceSamples()

    def finish(self, job: Job, status: int, error: str | None) -> None:
        """Metrics, slice outcome and trace of one request; once per request."""
        if job.done:
            return
        job.done = True
        e2e = max(self.clock() - job.started, 0.0)
        assembly = job.assembly
        if assembly is not None and status == 200 and not assembly.is_finished and error is None:
            error = CLIENT_DISCONNECTED
        stages = stage_seconds(assembly.timings if assembly else None)
        gateway_s = max(e2e - sum(v for v in stages.values() if v is not None), 0.0)
        ttft = None if job.first_token_at is None else job.first_token_at - job.started
        replica = job.replica if status == 200 else None
        self.metrics.requests.labels(job.endpoint, str(status), replica.replica_id if replica else "").inc()
        if status == 200:
            self.metrics.e2e.observe(e2e)
            self.metrics.overhead.observe(gateway_s)
            if ttft is not None and job.params is not None and job.params.stream:
                self.metrics.ttft.observe(ttft)
        trace = job_trace(job, status=status, error=error, e2e=e2e, gateway_s=gateway_s, ttft=ttft,
                          stages=stages, replica=replica)
        job.spans.finish(trace)
        outcome = Outcome.of(trace)
        self.samples.record(job.assignment, outcome)
        result = "ok" if outcome.ok else "failed"
        self.metrics.version_requests.labels(job.assignment.version or "stable", result).inc()
        if job.assignment.colour is not None:
            self.metrics.colour_requests.labels(job.assignment.colour, result).inc()
        try:
            self.on_trace(trace)
        except Exception:
            logger.exception("on_trace failed for request %s", trace.request_id)
