"""The model-version registry and the history of releases, kept in the store.

A version is a name for a model (a Hugging Face folder or a bundled model's name) with when it was added,
notes, and the figures of its last analysis. One version is current: what the stable fleet serves. A
release moves traffic from the current version to another, by steps (a canary) or replica by replica (a
rolling update); each release is a record with its steps and their decisions, written as it goes, so a
control plane restarted mid-release can say where it stopped.

Stored as documents (``records`` collections ``model_versions`` and ``releases``, the current version under
the ``rollouts.current`` setting): no schema change, and each write is durable when it returns.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from controlplane.errors import Conflict, NotFound, Refused
from controlplane.store.rows import Record

VERSIONS = "model_versions"
RELEASES = "releases"
CURRENT_KEY = "rollouts.current"
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9.-]{0,31}$")  # the gateway's split names (gateway.slices)
MAX_NOTES = 2_000
RELEASE_KINDS = ("canary", "rolling")
OUTCOMES = ("running", "promoted", "aborted", "paused")


class VersionError(Refused):
    """A bad version name, model or note."""


class VersionExists(Conflict):
    """A version of that name is already registered."""


class UnknownVersion(NotFound):
    """No version has that name."""


class DocumentStore(Protocol):
    """The part of :class:`controlplane.store.database.Store` the registry uses."""

    def add_record(self, collection: str, body: Any, key: str = "", ts: float | None = None) -> Record: ...
    def update_record(self, record_id: int, body: Any) -> Record: ...
    def records(self, collection: str, *, key: str | None = None, since: float | None = None,
                until: float | None = None, limit: int = ..., newest_first: bool = ...) -> list[Record]: ...
    def kv_put(self, key: str, value: Any) -> None: ...
    def kv_get(self, key: str, default: Any = None) -> Any: ...


@dataclass(slots=True, frozen=True)
class ModelVersion:
    name: str
    model: str  # a Hugging Face folder, or a bundled model's name (default, default-moe)
    created: float
    notes: str = ""
    last_analysis: dict[str, Any] | None = None  # the figures of its last canary step

    def __post_init__(self) -> None:
        if not NAME_PATTERN.match(self.name):
            raise VersionError(f"name: 1-32 of a-z, 0-9, '.' and '-', starting with a letter or digit; "
                               f"got {self.name!r}", param="name")
        if not self.model.strip():
            raise VersionError("model: must name a model folder or a bundled model", param="model")
        if len(self.notes) > MAX_NOTES:
            raise VersionError(f"notes: at most {MAX_NOTES} characters", param="notes")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "created": self.created, "notes": self.notes,
                "last_analysis": self.last_analysis}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ModelVersion:
        return cls(str(raw["name"]), str(raw["model"]), float(raw["created"]), str(raw.get("notes", "")),
                   raw.get("last_analysis"))


@dataclass(slots=True)
class Release:
    """One release; ``steps`` holds each step's decision record (share, window, analysis, decision)."""

    id: int
    version: str
    from_version: str
    kind: str  # canary | rolling
    started: float
    outcome: str = "running"  # running | promoted | aborted | paused
    ended: float | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "version": self.version, "from_version": self.from_version, "kind": self.kind,
                "started": self.started, "outcome": self.outcome, "ended": self.ended, "steps": self.steps,
                "reason": self.reason}


class VersionRegistry:
    def __init__(self, store: DocumentStore, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock

    # ---- versions ----
    def add(self, name: str, model: str, notes: str = "") -> ModelVersion:
        version = ModelVersion(name, model, self.clock(), notes)
        if self._record(name) is not None:
            raise VersionExists(f"version {name!r} is already registered", param="name", subject=name)
        self.store.add_record(VERSIONS, version.to_json(), key=name)
        return version

    def get(self, name: str) -> ModelVersion:
        record = self._record(name)
        if record is None:
            raise UnknownVersion(f"no version named {name!r}", param="name", subject=name)
        return ModelVersion.from_json(record.body)

    def all(self) -> list[ModelVersion]:
        return [ModelVersion.from_json(r.body) for r in self.store.records(VERSIONS, newest_first=False)]

    def set_analysis(self, name: str, analysis: dict[str, Any]) -> None:
        record = self._record(name)
        if record is None:
            raise UnknownVersion(f"no version named {name!r}", param="name", subject=name)
        self.store.update_record(record.id, {**record.body, "last_analysis": analysis})

    def current(self) -> str | None:
        value = self.store.kv_get(CURRENT_KEY)
        return None if value is None else str(value)

    def set_current(self, name: str) -> None:
        self.get(name)  # it must exist
        self.store.kv_put(CURRENT_KEY, name)

    def _record(self, name: str) -> Record | None:
        found = self.store.records(VERSIONS, key=name, limit=1)
        return found[0] if found else None

    # ---- releases ----
    def begin_release(self, version: str, from_version: str, kind: str) -> Release:
        if kind not in RELEASE_KINDS:
            raise VersionError(f"kind: must be one of {', '.join(RELEASE_KINDS)}", param="kind")
        self.get(version)
        release = Release(0, version, from_version, kind, self.clock())
        record = self.store.add_record(RELEASES, release.to_json(), key=version)
        release.id = record.id
        self.store.update_record(record.id, release.to_json())
        return release

    def save_release(self, release: Release) -> None:
        self.store.update_record(release.id, release.to_json())

    def releases(self, limit: int = 50) -> list[Release]:
        return [_release(r.body) for r in self.store.records(RELEASES, limit=limit)]


def _release(raw: dict[str, Any]) -> Release:
    return Release(int(raw["id"]), str(raw["version"]), str(raw["from_version"]), str(raw["kind"]),
                   float(raw["started"]), str(raw.get("outcome", "running")), raw.get("ended"),
                   list(raw.get("steps", [])), str(raw.get("reason", "")))
