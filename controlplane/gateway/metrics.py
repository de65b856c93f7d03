"""The gateway's own metrics (plain names): requests by status and replica, retries, resumes, ejections,
its overhead, and TTFT/E2E as the client sees them."""

from __future__ import annotations

import logging

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from inference.runtime_metrics import register_runtime_metrics

logger = logging.getLogger(__name__)

# ---- metrics ---------------------------------------------------------------------------------
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    """The gateway's own Prometheus series (plain names; the replicas export the vllm: ones)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        register_runtime_metrics(r)  # process_asyncio_tasks, for the soak benchmark
        self.requests = Counter("gateway_requests", "Requests answered, by endpoint, status and the "
                                "replica that produced the final token", ["endpoint", "status", "replica"],
                                registry=r)
        self.retries = Counter("gateway_retries", "Requests retried on another replica before the first "
                               "byte, by the replica that failed and why", ["replica", "reason"], registry=r)
        self.resumes = Counter("gateway_resumes", "Streams resumed on another replica mid-way, by the "
                               "replica that broke and why", ["replica", "reason"], registry=r)
        self.ejections = Counter("gateway_ejections", "Replicas ejected by outlier detection",
                                 ["replica"], registry=r)
        self.readmissions = Counter("gateway_readmissions", "Ejected replicas re-admitted by the probe",
                                    ["replica"], registry=r)
        self.rejected = Counter("gateway_rejected", "Requests refused before routing, by reason",
                                ["reason"], registry=r)
        self.inflight = Gauge("gateway_inflight_requests", "Upstream requests in flight, by replica",
                              ["replica"], registry=r)
        self.ejected = Gauge("gateway_ejected_replicas", "Replicas ejected now", registry=r)
        self.overhead = Histogram("gateway_overhead_seconds", "End-to-end time not spent in the replica's "
                                  "stages (routing, retries, proxying)", buckets=OVERHEAD_BUCKETS, registry=r)
        self.ttft = Histogram("gateway_time_to_first_token_seconds", "Time to the first token as the "
                              "client sees it", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("gateway_e2e_request_latency_seconds", "End-to-end request latency as the "
                             "client sees it", buckets=LATENCY_BUCKETS, registry=r)

    def page(self) -> bytes:
        return generate_latest(self.registry)


