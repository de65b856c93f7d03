"""Whether a drill may start: the steady state it checks before its load and its fault.

Met when the fleet has its capacity (every desired replica ready, no rollout in progress), chaos is not
halted, no fault is active, and one short greedy completion through the gateway streams its first token
within the scenario's SLO TTFT; each condition not met is a reason, in words.

Where it sits: :class:`chaos.drills.DrillRunner` calls :func:`steady_state` before it starts the load,
and again every ``STEADY_POLL_S`` while it is not met, up to the scenario's ``steady_state_timeout_s``
(the waiting, its notes and its abort stay with the runner); the probe's TTFT and end-to-end time feed
the drill's prediction (:func:`chaos.drill_figures.predict`).
"""

from __future__ import annotations

from typing import Any

import httpx

from chaos.clock import Clock
from chaos.drill_figures import FleetSample
from chaos.safety import FaultManager
from chaos.scenarios import Scenario


async def steady_state(sample: FleetSample, faults: FaultManager, sc: Scenario, gateway_url: str,
                       clock: Clock) -> dict[str, Any]:
    """The steady state now, from the fleet ``sample`` just taken: ``ok``, the ``reasons`` it is not met,
    the fleet's ``ready`` and ``desired`` replicas, and the probe's TTFT and end-to-end seconds."""
    reasons = []
    if not sample.has_capacity:
        reasons.append(f"fleet: {sample.ready} of {sample.desired} replicas ready"
                       + (", a rollout is in progress" if sample.changing else ""))
    if faults.is_halted:
        reasons.append("chaos is halted (release it first)")
    if faults.active():
        reasons.append(f"{len(faults.active())} faults are already active")
    ttft, e2e, error = await _probe(gateway_url, sc.max_tokens, clock)
    if error:
        reasons.append(f"gateway probe: {error}")
    elif ttft > sc.slo.ttft_p99_s:
        reasons.append(f"gateway probe: TTFT {ttft:.3f}s over the SLO's {sc.slo.ttft_p99_s:g}s")
    return {"ok": not reasons, "reasons": reasons, "ready": sample.ready, "desired": sample.desired,
            "probe_ttft_s": round(ttft, 4), "probe_e2e_s": round(e2e, 4)}


async def _probe(gateway_url: str, max_tokens: int, clock: Clock) -> tuple[float, float, str | None]:
    """One short greedy completion through the gateway: (TTFT, end-to-end, error)."""
    body = {"prompt": "drill steady-state probe", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    start = clock.now()
    ttft: float | None = None
    try:
        async with httpx.AsyncClient(base_url=gateway_url, timeout=30.0, trust_env=False) as client:
            listed = await client.get("/v1/models")
            if listed.status_code != 200:
                return 0.0, 0.0, f"GET /v1/models: HTTP {listed.status_code}"
            models = listed.json().get("data") or []
            if not models:  # no replica routable yet (starting, or all unready)
                return 0.0, 0.0, "the gateway lists no model (no replica routable yet)"
            body["model"] = models[0]["id"]
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    return 0.0, 0.0, f"HTTP {resp.status_code}"
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and ttft is None and '"text"' in line:
                        ttft = clock.now() - start
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return 0.0, 0.0, f"{type(exc).__name__}: {exc}"
    e2e = clock.now() - start
    return (ttft if ttft is not None else e2e), e2e, None
