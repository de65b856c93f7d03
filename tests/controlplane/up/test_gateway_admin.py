"""The control plane configures its gateway processes through their admin API: admission limits set at
run time take effect on the gateway (and are kept for gateways that start later), and a link fault's toxic
reaches the gateway and ends there by itself at the fault's duration."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.fleet.gateways import gateway_token

from .conftest import Running, shutdown, start, wait_ready, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN = "admin-token-for-gateway-admin-tests"
TOXIC_S = 3.0


def _admin(running: Running, path: str) -> Any:
    [gateway] = httpx.get(f"{running.api}/api/v1/gateways", timeout=10,
                          headers={"authorization": f"Bearer {running.token}"}).json()
    secret = (running.state_dir / "replica-admin.key").read_bytes()
    token = gateway_token(secret, gateway["name"], "admin")
    answer = httpx.get(f"http://127.0.0.1:{gateway['admin_port']}{path}",
                       headers={"authorization": f"Bearer {token}"}, timeout=10)
    answer.raise_for_status()
    return answer.json()


def test_admission_and_toxics_reach_the_gateway_process(model_state: Path) -> None:
    running = start(write_config(model_state), model_state, TOKEN)
    auth = {"authorization": f"Bearer {TOKEN}"}
    body = {"prompt": "hello", "max_tokens": 2}
    try:
        wait_ready(running, 3)
        set_limit = httpx.put(f"{running.api}/api/v1/gateway/admission", json={"rate_limit_rps": 1},
                              headers=auth, timeout=10)
        assert set_limit.status_code == 200 and set_limit.json()["applied"] == ["gw-0"], set_limit.text
        answers = [httpx.post(f"{running.gateway}/v1/completions", json=body, timeout=60) for _ in range(5)]
        limited = [a for a in answers if a.status_code == 429]
        assert limited and limited[0].headers.get("retry-after"), [a.status_code for a in answers]
        httpx.put(f"{running.api}/api/v1/gateway/admission", json={"rate_limit_rps": 0}, headers=auth,
                  timeout=10).raise_for_status()
        assert all(httpx.post(f"{running.gateway}/v1/completions", json=body, timeout=60).status_code == 200
                   for _ in range(3))

        fault = httpx.post(f"{running.api}/api/v1/chaos/faults", headers=auth, timeout=30, json={
            "kind": "link-delay", "params": {"latency_ms": 50}, "duration_s": TOXIC_S})
        assert fault.status_code == 200, fault.text
        toxics = _admin(running, "/admin/toxics")
        assert len(toxics) == 1 and toxics[0]["kind"] == "latency"
        deadline = time.monotonic() + TOXIC_S + 5
        while _admin(running, "/admin/toxics") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _admin(running, "/admin/toxics") == []  # ended by itself in the gateway
        audit = httpx.get(f"{running.api}/api/v1/audit", headers=auth, timeout=10).json()
        assert any(a["action"] == "gateway.admission" for a in audit)
    finally:
        shutdown(running)
