"""A typed client of the control plane's REST API, used by the CLI and the console.

HTTP and transport errors become :class:`ApiError` here, in one place, with the server's message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8080"
TOKEN_ENV = "CONTROLPLANE_TOKEN"


class ApiError(Exception):
    """A refused or failed API call; ``status`` is None when the server could not be reached."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True, frozen=True)
class ReplicaView:
    replica_id: str
    zone: str
    url: str
    state: str
    model: str
    pid: int | None
    generation: int


@dataclass(slots=True, frozen=True)
class FleetView:
    desired_replicas: int
    ready_replicas: int
    model: str
    generation: int
    zones: list[str]
    rollout: dict[str, Any] | None
    replicas: list[ReplicaView]


class ControlPlaneClient:
    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, *, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        token = token or os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout, trust_env=False,
                                  transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- fleet ---------------------------------------------------------------------------------
    def fleet(self) -> FleetView:
        raw = self._call("GET", "/api/v1/fleet")
        replicas = [ReplicaView(**r) for r in raw.pop("replicas")]
        return FleetView(replicas=replicas, **raw)

    def scale(self, replicas: int) -> None:
        self._call("POST", "/api/v1/fleet/scale", json={"replicas": replicas})

    def restart(self, replica_id: str) -> None:
        self._call("POST", f"/api/v1/fleet/replicas/{replica_id}/restart")

    def rollout(self, model: str) -> dict[str, Any]:
        return dict(self._call("POST", "/api/v1/fleet/rollout", json={"model": model}))

    # ---- observability -------------------------------------------------------------------------
    def events(self, *, since_id: int = 0, kind: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"since_id": since_id, "limit": limit}
        if kind:
            params["kind"] = kind
        return list(self._call("GET", "/api/v1/events", params=params))

    def summary(self, scope: str = "fleet") -> dict[str, Any]:
        return dict(self._call("GET", "/api/v1/metrics/summary", params={"scope": scope}))

    def slow_traces(self, limit: int = 50) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/traces/slow", params={"limit": limit}))

    def audit(self, limit: int = 200) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/audit", params={"limit": limit}))

    def issue_token(self, name: str, role: str, ttl_s: float | None = None) -> str:
        raw = self._call("POST", "/api/v1/tokens", json={"name": name, "role": role, "ttl_s": ttl_s})
        return str(raw["token"])

    # ---- chaos ---------------------------------------------------------------------------------
    def chaos_catalogue(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/chaos/catalogue"))

    def chaos_faults(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/chaos/faults"))

    def chaos_inject(self, kind: str, *, duration_s: float, selector: str = "COUNT(1)",
                     params: dict[str, Any] | None = None, replicas: list[str] | None = None,
                     zones: list[str] | None = None, allow_all: bool = False,
                     dry_run: bool = False) -> dict[str, Any]:
        body = {"kind": kind, "duration_s": duration_s, "selector": selector, "params": params or {},
                "replicas": replicas or [], "zones": zones or [], "allow_all": allow_all,
                "dry_run": dry_run}
        return dict(self._call("POST", "/api/v1/chaos/faults", json=body))

    def chaos_revert(self, fault_id: int) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/api/v1/chaos/faults/{fault_id}"))

    def chaos_halt(self) -> dict[str, Any]:
        return dict(self._call("POST", "/api/v1/chaos/halt"))

    def chaos_release(self) -> dict[str, Any]:
        return dict(self._call("POST", "/api/v1/chaos/release"))

    # ---- transport -----------------------------------------------------------------------------
    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(f"cannot reach the control plane at {self._http.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise ApiError(_message(response), status=response.status_code)
        return response.json()


def _message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else None
    except ValueError:
        message = None
    return f"HTTP {response.status_code}: {message or response.text[:200]}"
