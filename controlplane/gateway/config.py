"""The gateway's section of the configuration (``[gateway]``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from inference.config import TracingConfig, tracing_problems

ROUTING_POLICIES = ("score", "round-robin", "least-request", "power-of-two")


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    routing: str = "score"
    api_keys: list[str] = field(default_factory=list)  # empty: no client key needed (loopback default)
    max_retries: int = 2  # other replicas tried before the first byte
    retry_budget_ratio: float = 0.2  # retries allowed as a share of recent requests
    first_byte_timeout_s: float = 10.0
    stall_timeout_s: float = 2.0  # no token for this long mid-stream (or no response headers): go elsewhere
    eject_after_failures: int = 3  # consecutive failures before a replica is ejected
    probe_interval_s: float = 1.0  # active health checks (GET /ready) this often: ejected, stalled, idle
    probe_idle_replicas: bool = True  # idle replicas too: one silent for stall_timeout_s is routed around
    max_inflight_per_replica: int = 64  # beyond this on every replica: 429 before the stream starts
    rate_limit_rps: float = 0.0  # per API key; 0: off
    rate_limit_tokens_per_s: float = 0.0  # prompt + max_tokens per API key per second; 0: off
    retry_after_s: int = 1
    max_body_bytes: int = 4 << 20  # a request body above this is refused (413) before it is read
    processes: int = 1  # gateway processes sharing host:port (SO_REUSEPORT); each outlives the control plane
    admin_port: int = 0  # the first gateway's admin address (metrics, state, toxics); 0: any free port
    drain_timeout_s: float = 10.0  # at stop, streams in flight get this long to finish
    trace_sample_rate: float = 0.01  # traces kept below the running P95 (all above it are kept)
    trace_max_rows: int = 100_000
    # OpenTelemetry spans over OTLP/HTTP (controlplane/gateway/tracing.py), from the gateway and, passed on
    # as flags, from the replicas the control plane starts. Empty: off, at no cost per request.
    otlp_traces_endpoint: str = ""
    # Share of requests traced. A client's traceparent names the trace and its "not sampled" is followed,
    # but its "sampled" is not trusted (any client could force every export): such a request is kept at
    # this ratio too. The replicas follow the gateway's decision, which each upstream traceparent carries.
    otlp_sample_ratio: float = 1.0

    def tracing(self) -> TracingConfig:
        return TracingConfig(self.otlp_traces_endpoint, self.otlp_sample_ratio)


def gateway_problems(cfg: GatewayConfig) -> list[tuple[str, str]]:
    """(key, reason) for every bad value of ``[gateway]``."""
    problems: list[tuple[str, str]] = []
    for key, ok, reason in (
        ("port", 0 < cfg.port < 65536, f"must be a TCP port, got {cfg.port}"),
        ("routing", cfg.routing in ROUTING_POLICIES,
         f"must be one of {', '.join(ROUTING_POLICIES)}, got {cfg.routing!r}"),
        ("max_retries", cfg.max_retries >= 0, "must be >= 0"),
        ("retry_budget_ratio", 0 <= cfg.retry_budget_ratio <= 1, "must be in [0, 1]"),
        ("stall_timeout_s", cfg.stall_timeout_s > 0, "must be > 0"),
        ("probe_interval_s", cfg.probe_interval_s > 0, "must be > 0"),
        ("eject_after_failures", cfg.eject_after_failures >= 1, "must be >= 1"),
        ("trace_sample_rate", 0 <= cfg.trace_sample_rate <= 1, "must be in [0, 1]"),
        ("processes", 1 <= cfg.processes <= 64, "must be in [1, 64]"),
        ("max_body_bytes", 1024 <= cfg.max_body_bytes <= 1 << 30, "must be in [1 KiB, 1 GiB]"),
        ("admin_port", cfg.admin_port == 0 or 0 < cfg.admin_port < 65536 - cfg.processes,
         f"must be 0 (any free port) or a TCP port, got {cfg.admin_port}"),
        ("drain_timeout_s", cfg.drain_timeout_s >= 0, "must be >= 0"),
    ):
        if not ok:
            problems.append((f"gateway.{key}", reason))
    problems.extend((f"gateway.{key}", reason)
                    for key, reason in tracing_problems(cfg.otlp_traces_endpoint, cfg.otlp_sample_ratio))
    return problems
