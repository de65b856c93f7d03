"""Who did what and who is logged in: the audit log and a login's token (``/api/v1/audit``,
``/api/v1/auth/login``). Part of :mod:`controlplane.views`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class AuditEntry:
    actor: str
    role: str
    action: str  # such as "fleet.scale"
    target: str
    params: Mapping[str, Any]  # the request's (redacted) parameters: one shape per action
    outcome: str  # ok | denied | error
    detail: str = ""
    id: int | None = None
    ts: float | None = None


@dataclass(slots=True, frozen=True)
class Login:
    user: str
    role: str
    token: str
    ttl_s: float
