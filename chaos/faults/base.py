"""The shared vocabulary of fault kinds: a spec, a revert token, a kind's description and its errors.

Every kind implements :class:`Fault`: ``validate`` (pure; ValueError naming the field), ``prepare`` (the
revert record written to the ledger *before* the fault goes in), ``inject`` (returns the exact record of
what to undo) and ``revert`` (idempotent: reverting twice, or reverting what is already gone, succeeds).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chaos.errors import ChaosError, Refused
from chaos.targets import Selector, Target

Scalar = str | int | float | bool | None


class FaultError(ChaosError):
    """A fault could not be validated, injected or reverted."""


class FaultUnavailable(FaultError, Refused):
    """The kind exists but cannot run here (a missing tool, capability or module): retrying will not help."""


class RevertFailed(FaultError):
    """A revert did not complete; ``retryable`` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(slots=True, frozen=True)
class RevertResult:
    """How one revert went; a failure is a value (``ok`` False), with whether a retry may help."""

    fault_id: int
    ok: bool
    detail: str = ""
    retryable: bool = False



@dataclass(slots=True, frozen=True)
class FaultSpec:
    """What to inject, with what parameters, for how long, and where."""

    kind: str
    params: Mapping[str, Scalar] = field(default_factory=dict)
    duration_s: float = 30.0
    selector: Selector = field(default_factory=Selector)

    def __post_init__(self) -> None:
        if not self.kind:
            raise ValueError("kind: required")
        if isinstance(self.duration_s, bool) or not isinstance(self.duration_s, (int, float)) \
                or not math.isfinite(self.duration_s) or self.duration_s <= 0:
            raise ValueError(f"duration_s: must be a positive number of seconds, got {self.duration_s!r}")
        object.__setattr__(self, "params", dict(self.params))


@dataclass(slots=True, frozen=True)
class RevertToken:
    """A JSON-serialisable record of exactly what must be undone, enough to revert after a crash.

    ``action`` is what revert does (``"none"`` for faults the fleet repairs by itself); ``data`` holds the
    kind's fields (a pid and its start time, an admin URL and a replica fault id). Secrets never go in.
    """

    kind: str
    target: str
    action: str
    data: Mapping[str, Scalar] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "action": self.action, "data": dict(self.data)}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RevertToken:
        try:
            kind, target, action, data = body["kind"], body["target"], body["action"], body.get("data", {})
        except KeyError as exc:
            raise ValueError(f"revert token: {exc.args[0]}: required") from exc
        if not all(isinstance(v, str) for v in (kind, target, action)) or not isinstance(data, Mapping):
            raise ValueError(f"revert token: malformed {dict(body)!r}")
        return cls(kind=kind, target=target, action=action, data=dict(data))


@dataclass(slots=True, frozen=True)
class ParamInfo:
    name: str
    type: str  # "number" | "integer" | "string"
    description: str
    required: bool = True
    default: Scalar = None


@dataclass(slots=True, frozen=True)
class FaultKindInfo:
    """What ``describe()`` tells a person or a console about one kind."""

    kind: str
    family: str
    description: str
    params: tuple[ParamInfo, ...] = ()
    takes_down: bool = False  # the target stops serving (counts against the blast radius)
    impairs: bool = False  # the target keeps serving, with less of its host (counts against it too)
    available: bool = True
    unavailable_reason: str | None = None


class Fault(abc.ABC):
    """One fault kind. Instances hold configuration only; per-fault state lives in the revert token.

    ``expires_by_itself``: the fault ends at its duration where it lives (a replica's own fault hook, a
    gateway's toxic, stress-ng's ``--timeout``), whether or not anyone reverts it. For the others (a paused
    process, a partition) the fault manager starts an expiry guard (:mod:`chaos.expiry`) that reverts it
    on time even if the process that injected it has died.
    """

    expires_by_itself = False

    @abc.abstractmethod
    def describe(self) -> FaultKindInfo: ...

    @abc.abstractmethod
    def validate(self, spec: FaultSpec) -> None:
        """Raise ValueError naming the offending field; no I/O."""

    @abc.abstractmethod
    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        """The revert record to register before injecting: safe to apply even if inject never ran."""

    @abc.abstractmethod
    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        """Put the fault in place; FaultError when it could not be."""

    @abc.abstractmethod
    async def revert(self, token: RevertToken) -> None:
        """Undo ``token``; idempotent. RevertFailed when it could not be undone."""

    @property
    def kind(self) -> str:
        return self.describe().kind


def check_params(spec: FaultSpec, info: FaultKindInfo) -> dict[str, Scalar]:
    """The spec's params checked against the kind's schema (names, presence, types), defaults filled in."""
    known = {p.name: p for p in info.params}
    unknown = sorted(set(spec.params) - set(known))
    if unknown:
        allowed = ", ".join(known) or "none"
        raise ValueError(f"params.{unknown[0]}: unknown parameter for {info.kind} (allowed: {allowed})")
    out: dict[str, Scalar] = {}
    for name, p in known.items():
        value = spec.params.get(name, p.default)
        if value is None:
            if p.required:
                raise ValueError(f"params.{name}: required for {info.kind}")
            continue
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if p.type in ("number", "integer") and not is_number:
            raise ValueError(f"params.{name}: must be a number, got {value!r}")
        if p.type == "integer" and value != int(value):
            raise ValueError(f"params.{name}: must be a whole number, got {value!r}")
        if p.type == "string" and not isinstance(value, str):
            raise ValueError(f"params.{name}: must be a string, got {value!r}")
        out[name] = value
    return out
