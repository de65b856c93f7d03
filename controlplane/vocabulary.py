"""Words the REST API, the control plane and the console share: trace names, autoscaling policy names and
the autoscaler's target keys. One home, so that a console form and the API it posts to cannot drift apart.

The console reads them through ``controlplane.client`` (which re-exports them); the control plane imports
them from here.
"""

from __future__ import annotations

from chaos.scenarios import AZURE_TRACE

# ---- traces ------------------------------------------------------------------------------------
SYNTHETIC_BURSTY = "synthetic-bursty"  # the seeded synthetic trace of the what-if simulator
INLINE_TRACE = "inline"  # a what-if run's requests sent in its body
SIMULATION_TRACES = (SYNTHETIC_BURSTY, AZURE_TRACE, INLINE_TRACE)

# ---- autoscaling policies (what-if runs) ----------------------------------------------------------
OURS = "ours"  # the control plane's own decision (target tracking, panic mode, guards, anomaly source)
HPA = "hpa"  # Kubernetes' HorizontalPodAutoscaler formula on the same metrics
STATIC = "static"  # a fixed count, written static:N
DEFAULT_POLICIES = (OURS, HPA)


def static_policy(replicas: int) -> str:
    """``static:N``: the policy that keeps ``replicas`` replicas."""
    return f"{STATIC}:{replicas}"


# ---- the autoscaler's targets ----------------------------------------------------------------------
# What it observes per tick, by name; target tracking keeps each near its target per ready replica.
AUTOSCALER_METRICS = ("waiting_per_replica", "kv_cache_usage", "ttft_p95_s", "tokens_per_s_per_replica",
                      "engine_load_per_replica")
# ``PUT /api/v1/autoscaler/config`` takes ``targets: {metric: value}``; each sets this configuration key.
AUTOSCALER_TARGETS: dict[str, str] = {
    "waiting_per_replica": "target_waiting_per_replica",
    "kv_cache_usage": "target_kv_cache_usage",
    "ttft_p95_s": "ttft_slo_s",
    "tokens_per_s_per_replica": "target_tokens_per_s_per_replica",
    "engine_load_per_replica": "target_engine_load_per_replica",
}

__all__ = ["AUTOSCALER_METRICS", "AUTOSCALER_TARGETS", "AZURE_TRACE", "DEFAULT_POLICIES", "HPA",
           "INLINE_TRACE", "OURS", "SIMULATION_TRACES", "STATIC", "SYNTHETIC_BURSTY", "static_policy"]
