"""Replica faults: the replica's own hooks behind ``/admin/faults``, driven over HTTP with its admin token.

Inject is ``PUT /admin/faults`` with the kind's parameters and duration; the token records the replica's
fault id and revert is ``DELETE /admin/faults/{id}`` (404 means it already expired or was removed). The
record registered before inject has no id yet; reverting it deletes the replica's faults of the same
kind and parameters started since, which is what a crash between PUT and the ledger write leaves.

The admin token travels in clear HTTP, so only loopback admin URLs are accepted, and proxies from the
environment are ignored. Tokens never go into revert records; a revert after a restart asks
``admin_tokens(replica_id)`` for one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Any

import httpx

from chaos.faults.base import (
    Fault,
    FaultError,
    FaultKindInfo,
    FaultSpec,
    ParamInfo,
    RevertFailed,
    RevertToken,
    Scalar,
    check_params,
)
from chaos.targets import Target
from inference.faults import FaultSpec as ReplicaFaultSpec

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
CLOCK_SKEW_S = 1.0  # how much earlier than registration a replica's started_at may read (same host)

_SECONDS = ParamInfo("seconds", "number", "extra seconds (0, 60]")
_PROBABILITY = ParamInfo("probability", "number", "share of new requests refused (0, 1]")
_STATUS = ParamInfo("status_code", "integer", "status of the refusals: 500 or 503", required=False,
                    default=500)
_FRACTION = ParamInfo("fraction", "number", "share of KV blocks held back (0, 1]")
_COLOUR = ParamInfo("colour", "string", "only requests of this colour (the gateway colours a slice of "
                    "traffic; x-llmsre-colour); absent: every request", required=False)


@dataclass(slots=True, frozen=True)
class _Kind:
    kind: str
    description: str
    params: tuple[ParamInfo, ...] = ()
    takes_down: bool = False


_KINDS = {k.kind: k for k in (
    _Kind("token_latency", "extra seconds per decode step (coloured: per token of that colour's requests)",
          (_SECONDS, _COLOUR)),
    _Kind("prefill_delay", "extra seconds before each step that computes a prompt (coloured: before the "
          "first token of that colour's requests)", (_SECONDS, _COLOUR)),
    _Kind("error_rate", "refuse a share of new requests (coloured: of that colour's)",
          (_PROBABILITY, _STATUS, _COLOUR)),
    _Kind("hang", "accept requests and emit nothing", takes_down=True),
    _Kind("device_failure", "in-flight requests fail; readiness and liveness answer 503", takes_down=True),
    _Kind("kv_pressure", "hold back a fraction of the KV cache blocks", (_FRACTION,)),
    _Kind("crash", "the replica exits at once; the fleet restarts it (revert is a no-op)", takes_down=True),
)}

_MATCHED_FIELDS = ("duration_s", "seconds", "probability", "status_code", "fraction", "colour")
AdminTokens = Callable[[str], str | None]  # replica_id -> admin token


def _is_loopback(url: httpx.URL) -> bool:
    if url.host == "localhost":
        return True
    try:
        return ip_address(url.host).is_loopback
    except ValueError:
        return False


class ReplicaFault(Fault):
    expires_by_itself = True  # the replica ends its own fault hooks at their duration

    def __init__(self, kind: str, *, admin_tokens: AdminTokens | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, transport: httpx.AsyncBaseTransport | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if kind not in _KINDS:
            raise ValueError(f"kind: must be one of {', '.join(_KINDS)}, got {kind!r}")
        self._kind = _KINDS[kind]
        self._admin_tokens = admin_tokens
        self._timeout_s = timeout_s
        self._transport = transport
        self._wall_clock = wall_clock
        self._seen_tokens: dict[str, str] = {}  # replica_id -> admin token, from targets injected here

    def describe(self) -> FaultKindInfo:
        k = self._kind
        return FaultKindInfo(kind=k.kind, family="replica", description=k.description, params=k.params,
                             takes_down=k.takes_down)

    def validate(self, spec: FaultSpec) -> None:
        self._body(spec)

    def _body(self, spec: FaultSpec) -> dict[str, Any]:
        if spec.kind != self._kind.kind:
            raise ValueError(f"kind: expected {self._kind.kind!r}, got {spec.kind!r}")
        params = check_params(spec, self.describe())
        body: dict[str, Any] = {"kind": spec.kind, "duration_s": spec.duration_s, **params}
        ReplicaFaultSpec.from_json(body)  # the replica's own ranges, so both sides agree on what is valid
        return body

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        body = self._body(spec)
        url = self._checked_url(target.admin_url)
        action = "none" if spec.kind == "crash" else "delete"
        data: dict[str, Scalar] = {"admin_url": str(url), "fault_id": None,
                                   "not_before": self._wall_clock(), **body}
        return RevertToken(kind=spec.kind, target=target.replica_id, action=action, data=data)

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        token = self.prepare(spec, target)
        body = self._body(spec)
        if target.admin_token:
            self._seen_tokens[target.replica_id] = target.admin_token
        admin = self._token_for(target.replica_id)
        if admin is None:
            raise FaultError(f"{target.replica_id}: no admin token for the replica's fault hooks")
        try:
            async with self._client(admin) as client:
                response = await client.put(str(token.data["admin_url"]), json=body)
        except httpx.HTTPError as exc:
            raise FaultError(f"{target.replica_id}: PUT /admin/faults failed: {exc!r}") from exc
        if response.status_code != 201:
            raise FaultError(f"{target.replica_id}: PUT /admin/faults answered {response.status_code}: "
                             f"{response.text[:200]}")
        fault_id = response.json().get("id")
        if not isinstance(fault_id, str):
            raise FaultError(f"{target.replica_id}: PUT /admin/faults returned no fault id")
        logger.warning("%s: injected %s as %s for %.1fs", target.replica_id, spec.kind, fault_id,
                       spec.duration_s)
        return RevertToken(kind=token.kind, target=token.target, action=token.action,
                           data={**token.data, "fault_id": fault_id})

    async def revert(self, token: RevertToken) -> None:
        if token.action == "none":
            return
        if token.action != "delete" or not isinstance(token.data.get("admin_url"), str):
            raise RevertFailed(f"{token.target}: malformed revert token {token.to_json()!r}", retryable=False)
        admin = self._token_for(token.target)
        if admin is None:
            raise RevertFailed(f"{token.target}: no admin token to revert {token.kind}", retryable=False)
        url = str(token.data["admin_url"])
        try:
            async with self._client(admin) as client:
                fault_id = token.data.get("fault_id")
                ids = [fault_id] if isinstance(fault_id, str) else await self._matching(client, url, token)
                for fid in ids:
                    await self._delete(client, f"{url}/{fid}", token)
        except httpx.ConnectError:
            # Nothing listens on the port: the process is gone and its in-memory faults with it.
            logger.info("%s: replica not listening; %s is gone with it", token.target, token.kind)
        except httpx.HTTPError as exc:
            msg = f"{token.target}: revert {token.kind} failed: {exc!r}"
            raise RevertFailed(msg, retryable=True) from exc

    async def _matching(self, client: httpx.AsyncClient, url: str, token: RevertToken) -> list[str]:
        response = await client.get(url)
        _raise_for_status(response, token)
        keys = [k for k in _MATCHED_FIELDS if k in token.data]
        not_before = float(token.data.get("not_before") or 0.0) - CLOCK_SKEW_S
        return [str(f["id"]) for f in response.json().get("faults", [])
                if f.get("kind") == token.kind and f.get("started_at", 0.0) >= not_before
                and all(f.get(k) == token.data[k] for k in keys)]

    async def _delete(self, client: httpx.AsyncClient, url: str, token: RevertToken) -> None:
        response = await client.delete(url)
        if response.status_code == 404:
            logger.info("%s: %s already gone (%s)", token.target, token.kind, url)
            return
        _raise_for_status(response, token)
        logger.warning("%s: reverted %s (%s)", token.target, token.kind, url)

    def _token_for(self, replica_id: str) -> str | None:
        seen = self._seen_tokens.get(replica_id)
        if seen is not None:
            return seen
        return self._admin_tokens(replica_id) if self._admin_tokens is not None else None

    def _checked_url(self, admin_url: str) -> httpx.URL:
        url = httpx.URL(admin_url)
        if url.scheme != "http" or not _is_loopback(url):
            raise FaultError(f"admin_url: must be http on a loopback address, got {admin_url!r}")
        return url

    def _client(self, admin_token: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(trust_env=False, timeout=self._timeout_s, transport=self._transport,
                                 headers={"Authorization": f"Bearer {admin_token}"})


def _raise_for_status(response: httpx.Response, token: RevertToken) -> None:
    if response.status_code < 400:
        return
    retryable = response.status_code >= 500 or response.status_code == 429
    raise RevertFailed(f"{token.target}: {response.request.method} {response.request.url.path} answered "
                       f"{response.status_code}: {response.text[:200]}", retryable=retryable)


def replica_faults(*, admin_tokens: AdminTokens | None = None, **options: Any) -> list[Fault]:
    return [ReplicaFault(kind, admin_tokens=admin_tokens, **options) for kind in _KINDS]
