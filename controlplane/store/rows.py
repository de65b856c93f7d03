"""The store's values: the rows it hands out (events, replicas, audit records, tokens, users, faults,
JSON records), the fault and outcome vocabularies, and the redaction applied to audit parameters.

Pure data: :mod:`controlplane.store.database` reads and writes them; nothing here touches SQLite beyond
turning a
``sqlite3.Row`` into a value.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from controlplane.replicas import ReplicaState

Outcome = Literal["ok", "denied", "error"]
FaultState = Literal["registered", "injected", "reverted", "revert_failed"]
OUTCOMES: tuple[str, ...] = get_args(Outcome)
FAULT_STATES: tuple[str, ...] = get_args(FaultState)
# "registered" is active too: the ledger records the revert before the inject, so after a crash a
# registered fault may or may not be in place, and reverting it is the safe side.
ACTIVE_FAULT_STATES: tuple[str, ...] = ("registered", "injected", "revert_failed")

REDACTED = "***"
_SECRET_KEY = re.compile(r"token|password|secret|key|authorization|credential|cookie", re.IGNORECASE)
_ALWAYS_SECRET_KEY = re.compile(r"password|secret|authorization|credential|cookie", re.IGNORECASE)


# ---- values ----------------------------------------------------------------------------------
def require_text(**values: str) -> None:
    for name, value in values.items():
        if not value:
            raise ValueError(f"{name} must not be empty")


@dataclass(slots=True, frozen=True)
class Event:
    id: int
    ts: float  # wall clock, POSIX seconds
    kind: str  # noun.verb, such as "replica.spawned"
    subject: str  # what it happened to, such as a replica id
    detail: dict[str, Any]


@dataclass(slots=True, frozen=True)
class ReplicaRow:
    """One replica as the registry remembers it, enough to find its process again after a crash."""

    replica_id: str
    zone: str
    host: str
    port: int
    pid: int | None
    state: ReplicaState
    model: str
    generation: int = 0
    started_at: float = 0.0  # wall clock
    restarts: int = 0
    version: str = ""  # a canary's version; "" for the stable fleet

    def __post_init__(self) -> None:
        require_text(replica_id=self.replica_id, zone=self.zone, host=self.host, model=self.model)
        if not isinstance(self.state, ReplicaState):  # a state's value ("ready") is accepted too
            object.__setattr__(self, "state", ReplicaState(self.state))
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be a TCP port, got {self.port}")
        if self.pid is not None and self.pid <= 0:
            raise ValueError(f"pid must be positive or None, got {self.pid}")
        if self.generation < 0 or self.restarts < 0:
            raise ValueError("generation and restarts must be >= 0")


@dataclass(slots=True, frozen=True)
class AuditRecord:
    """Who did what to what, with which (redacted) parameters, and how it ended."""

    actor: str
    role: str
    action: str  # such as "fleet.scale"
    target: str
    params: dict[str, Any]
    outcome: Outcome
    detail: str = ""
    id: int | None = None  # set by the store
    ts: float | None = None  # set by the store

    def __post_init__(self) -> None:
        require_text(actor=self.actor, action=self.action)
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, got {self.outcome!r}")


@dataclass(slots=True, frozen=True)
class TokenRow:
    name: str
    role: str
    token_hash: str  # hex SHA-256 of the secret; the secret itself is never stored
    created_at: float
    expires_at: float | None
    revoked_at: float | None = None

    def is_active(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)


@dataclass(slots=True, frozen=True)
class UserRow:
    name: str
    password_hash: str
    role: str
    created_at: float


@dataclass(slots=True, frozen=True)
class FaultRow:
    """One entry of the faults ledger: what was (or is about to be) injected, and how to undo it."""

    id: int
    kind: str
    target: str
    params: dict[str, Any]
    state: FaultState
    revert: dict[str, Any]
    created: float
    updated: float
    detail: str = ""

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_FAULT_STATES


@dataclass(slots=True, frozen=True)
class Record:
    """One JSON document of a collection (drill reports, autoscaler decisions, alert states, ...).

    ``key`` groups documents inside a collection (a drill id, an alert rule name); ``ts`` is when the
    document was first written.
    """

    id: int
    collection: str
    key: str
    ts: float
    updated: float
    body: dict[str, Any]


@dataclass(slots=True, frozen=True)
class StorePragmas:
    """The connection settings as SQLite reports them (for tests and diagnostics)."""

    journal_mode: str
    synchronous: str
    busy_timeout_ms: int
    foreign_keys: bool
    user_version: int


def redact(params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``params`` with secret-looking values replaced by ``***``, recursively.

    A key matching token|password|secret|key (any case) hides its value. Numbers, booleans and None under
    token/key names stay readable (``max_tokens: 64`` is a count, not a secret); under password/secret
    names everything is hidden.
    """
    return {key: REDACTED if _is_secret(str(key), value) else _redact_value(value)
            for key, value in params.items()}


def _is_secret(key: str, value: Any) -> bool:
    if not _SECRET_KEY.search(key):
        return False
    if _ALWAYS_SECRET_KEY.search(key):
        return True
    return not (value is None or isinstance(value, bool | int | float))


def _redact_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return redact(value)
    if isinstance(value, list | tuple):
        return [_redact_value(item) for item in value]
    return value



def token_row(r: sqlite3.Row) -> TokenRow:
    return TokenRow(name=r["name"], role=r["role"], token_hash=r["token_hash"], created_at=r["created_at"],
                    expires_at=r["expires_at"], revoked_at=r["revoked_at"])


def user_row(r: sqlite3.Row) -> UserRow:
    return UserRow(name=r["name"], password_hash=r["password_hash"], role=r["role"],
                   created_at=r["created_at"])


def fault_row(r: sqlite3.Row) -> FaultRow:
    return FaultRow(id=r["id"], kind=r["kind"], target=r["target"], params=json.loads(r["params"]),
                    state=r["state"], revert=json.loads(r["revert"]), created=r["created"],
                    updated=r["updated"], detail=r["detail"])


def record_row(r: sqlite3.Row) -> Record:
    return Record(id=r["id"], collection=r["collection"], key=r["key"], ts=r["ts"], updated=r["updated"],
                  body=json.loads(r["body"]))
