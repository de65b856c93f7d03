"""The gateway's own metrics (``llmsre_gateway_*``): requests by status and replica, retries, resumes,
ejections, its overhead, and TTFT/E2E as the client sees them."""

from __future__ import annotations

import logging

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from inference.runtime_metrics import NAMESPACE, register_runtime_metrics

logger = logging.getLogger(__name__)

# ---- metrics ---------------------------------------------------------------------------------
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
PREFIX = f"{NAMESPACE}gateway_"
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    """The gateway's own Prometheus series (``llmsre_gateway_*``; the replicas export the vllm: ones)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        register_runtime_metrics(r)  # llmsre_asyncio_tasks, for the soak benchmark
        self.requests = Counter(f"{PREFIX}requests", "Requests answered, by endpoint, status and the "
                                "replica that produced the final token", ["endpoint", "status", "replica"],
                                registry=r)
        self.retries = Counter(f"{PREFIX}retries", "Requests retried on another replica before the first "
                               "byte, by the replica that failed and why", ["replica", "reason"], registry=r)
        self.resumes = Counter(f"{PREFIX}resumes", "Streams resumed on another replica mid-way, by the "
                               "replica that broke and why", ["replica", "reason"], registry=r)
        self.ejections = Counter(f"{PREFIX}ejections", "Replicas ejected by outlier detection",
                                 ["replica"], registry=r)
        self.readmissions = Counter(f"{PREFIX}readmissions", "Ejected replicas re-admitted by the probe",
                                    ["replica"], registry=r)
        self.version_requests = Counter(f"{PREFIX}version_requests", "Requests answered by the model version "
                                        "the traffic split sent them to (stable: outside every share), by "
                                        "outcome (ok, failed)", ["version", "outcome"], registry=r)
        self.colour_requests = Counter(f"{PREFIX}colour_requests", "Coloured requests answered, by colour "
                                       "and outcome (ok, failed)", ["colour", "outcome"], registry=r)
        self.rejected = Counter(f"{PREFIX}rejected", "Requests refused before routing, by reason",
                                ["reason"], registry=r)
        self.refused: dict[str, int] = {}  # the same counts, read by the control plane (/admin/state)
        self.inflight = Gauge(f"{PREFIX}inflight_requests", "Upstream requests in flight, by replica",
                              ["replica"], registry=r)
        self.ejected = Gauge(f"{PREFIX}ejected_replicas", "Replicas ejected now", registry=r)
        self.overhead = Histogram(f"{PREFIX}overhead_seconds", "End-to-end time not spent in the replica's "
                                  "stages (routing, retries, proxying)", buckets=OVERHEAD_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to the first token as the "
                              "client sees it", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "End-to-end request latency as the "
                             "client sees it", buckets=LATENCY_BUCKETS, registry=r)

    def refuse(self, reason: str) -> None:
        """One request refused before routing (``unauthorized``, ``no_replica``, ``shed_<priority>``,
        ``rate_limited``): the Prometheus series and the plain count the control plane reads."""
        self.rejected.labels(reason).inc()
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def page(self) -> bytes:
        return generate_latest(self.registry)


