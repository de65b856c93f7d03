"""Traffic slices: which model version a request goes to and which colour it carries, and what each slice saw.

The control plane publishes a :class:`SlicePlan` with the replica set (the endpoints API, so a gateway keeps
the last plan it knew, as it keeps the replicas, when the control plane is away):

- ``split``: the share of requests each model version receives, independent of how many replicas each
  version runs (a canary at 5% on one replica beside nine stable ones gets 5%, not 10%). Requests outside
  every share go to the stable version (``""``).
- ``colours``: named shares of requests that carry a colour (the ``x-llmsre-colour`` header and
  ``llmsre.colour`` in W3C baggage) to the replica, where a fault can target that colour only. A chaos
  experiment takes two slices of one size: the experiment colour, which faults touch, and a control colour,
  which they do not.

Assignment is sticky: a request's place in [0, 1) is a hash of its conversation (the ``x-session-id``
header, else the first block of its prompt, which every turn of a conversation repeats), so a
conversation does not flip between versions as it goes on; version and colour use independent hashes,
so a colour cuts across versions. Every finished request is recorded in its slices (:class:`SliceSamples`:
bounded per slice), which the control plane reads from the gateway's admin API to compare the two sides.
Pure bookkeeping: no I/O and no clock of its own.
"""

from __future__ import annotations

import hashlib
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controlplane.replicas import ReplicaEndpoint
from controlplane.traces import TraceRecord
from inference.faults import BAGGAGE_COLOUR_KEY, COLOUR_HEADER, COLOUR_PATTERN

SESSION_HEADER = "x-session-id"
VERSION_LABEL = "version"  # the replica label that puts a replica in a version's pool
STABLE = ""  # the version of every request outside the split's shares
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9.-]{0,31}$")
SAMPLES_PER_SLICE = 20_000


@dataclass(slots=True, frozen=True)
class Share:
    name: str
    share: float  # of all requests, in [0, 1]

    def __post_init__(self) -> None:
        if not NAME_PATTERN.match(self.name):
            raise ValueError(f"name: 1-32 of a-z, 0-9, '.' and '-', got {self.name!r}")
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share of {self.name!r}: must be in [0, 1], got {self.share!r}")


@dataclass(slots=True, frozen=True)
class SlicePlan:
    split: tuple[Share, ...] = ()  # model version -> share; the rest: the stable version
    colours: tuple[Share, ...] = ()  # colour -> share

    def __post_init__(self) -> None:
        for what, shares in (("split", self.split), ("colours", self.colours)):
            names = [s.name for s in shares]
            if len(set(names)) != len(names):
                raise ValueError(f"{what}: a name appears twice")
            if sum(s.share for s in shares) > 1.0 + 1e-9:
                raise ValueError(f"{what}: the shares add up to more than 1")
        for s in self.colours:  # as the replicas read them (inference.faults)
            if not COLOUR_PATTERN.match(s.name):
                raise ValueError(f"colour {s.name!r}: 1-32 of a-z, 0-9 and '-'")

    @property
    def is_empty(self) -> bool:
        return not self.split and not self.colours

    def share_of(self, version: str) -> float:
        if version == STABLE:
            return 1.0 - sum(s.share for s in self.split)
        return next((s.share for s in self.split if s.name == version), 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"split": {s.name: s.share for s in self.split},
                "colours": {s.name: s.share for s in self.colours}}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | None) -> SlicePlan:
        """``ValueError`` (or ``TypeError``) for a malformed plan."""
        if not raw:
            return cls()
        return cls(split=_shares(raw.get("split") or {}), colours=_shares(raw.get("colours") or {}))


def _shares(raw: Mapping[str, Any]) -> tuple[Share, ...]:
    return tuple(Share(str(name), float(share)) for name, share in sorted(raw.items()) if float(share) > 0)


@dataclass(slots=True, frozen=True)
class Assignment:
    version: str = STABLE
    colour: str | None = None

    def upstream_headers(self) -> dict[str, str]:
        """What tells the replica the request's colour (nothing for an uncoloured request)."""
        if self.colour is None:
            return {}
        return {COLOUR_HEADER: self.colour, "baggage": f"{BAGGAGE_COLOUR_KEY}={self.colour}"}

    def slices(self) -> list[str]:
        """The slices this request is recorded in."""
        names = [f"version:{self.version or 'stable'}"]
        if self.colour is not None:
            names.append(f"colour:{self.colour}")
        return names


def conversation_key(headers: Mapping[str, str], block_hashes: Sequence[int], request_id: str) -> str:
    """What keeps a conversation on one version: its session header, its first prompt block, or itself."""
    session = headers.get(SESSION_HEADER)
    if session:
        return f"session:{session}"
    if block_hashes:
        return f"prefix:{block_hashes[0]}"
    return f"request:{request_id}"


def position(key: str, salt: str) -> float:
    """A uniform place in [0, 1) for ``key``; independent for different salts."""
    digest = hashlib.blake2b(f"{salt}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _pick(shares: Iterable[Share], place: float) -> str | None:
    edge = 0.0
    for s in shares:
        edge += s.share
        if place < edge:
            return s.name
    return None


def assign(plan: SlicePlan, key: str) -> Assignment:
    if plan.is_empty:
        return Assignment()
    version = _pick(plan.split, position(key, "version")) or STABLE
    return Assignment(version, _pick(plan.colours, position(key, "colour")))


def version_of(endpoint: ReplicaEndpoint) -> str:
    return dict(endpoint.labels).get(VERSION_LABEL, STABLE)


def endpoints_for(version: str, endpoints: Sequence[ReplicaEndpoint], plan: SlicePlan,
                  ) -> list[ReplicaEndpoint]:
    """The pool of a request assigned to ``version``: the replicas labelled with it, while one is ready;
    otherwise (and for the stable version) every replica of no version in the split, so a canary that
    is not serving yet, or any more, sends its share back to the stable fleet."""
    if plan.is_empty:
        return list(endpoints)
    if version != STABLE:
        mine = [e for e in endpoints if version_of(e) == version]
        if any(e.state.is_routable for e in mine):
            return mine
    split = {s.name for s in plan.split}
    rest = [e for e in endpoints if version_of(e) not in split]
    return rest or list(endpoints)


# ---- what each slice saw ---------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Outcome:
    at: float  # wall clock when the request finished
    ok: bool  # the client got its whole answer
    ttft_s: float | None
    tpot_s: float | None  # mean seconds per output token after the first

    def to_json(self) -> list[Any]:
        return [round(self.at, 3), self.ok, self.ttft_s, self.tpot_s]

    @classmethod
    def of(cls, trace: TraceRecord) -> Outcome:
        ok = trace.status == 200 and trace.error is None
        tpot = None
        if ok and trace.ttft_s is not None and trace.output_tokens > 1:
            tpot = (trace.e2e_s - trace.ttft_s) / (trace.output_tokens - 1)
        return cls(trace.started_at + trace.e2e_s, ok, trace.ttft_s if ok else None, tpot)

    @classmethod
    def from_json(cls, raw: Sequence[Any]) -> Outcome:
        at, ok, ttft, tpot = raw
        return cls(float(at), bool(ok), None if ttft is None else float(ttft),
                   None if tpot is None else float(tpot))


@dataclass(slots=True)
class SliceSamples:
    """The latest outcomes of each slice, bounded per slice."""

    capacity: int = SAMPLES_PER_SLICE
    _by_slice: dict[str, deque[Outcome]] = field(default_factory=dict)

    def record(self, assignment: Assignment, outcome: Outcome) -> None:
        for name in assignment.slices():
            samples = self._by_slice.get(name)
            if samples is None:
                samples = self._by_slice[name] = deque(maxlen=self.capacity)
            samples.append(outcome)

    def since(self, at: float) -> dict[str, list[Outcome]]:
        return {name: [o for o in samples if o.at >= at] for name, samples in self._by_slice.items()}

    def to_json(self, at: float) -> dict[str, list[list[Any]]]:
        return {name: [o.to_json() for o in outcomes] for name, outcomes in self.since(at).items()}
