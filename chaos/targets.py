"""What a fault is aimed at, and how an experiment picks its victims.

The control plane's replica endpoints satisfy :class:`Target` (chaos never imports the control plane).
A :class:`Selector` is resolved once, when a fault starts, into a frozen tuple: a replica that joins the
fleet afterwards is never hit by a fault already running.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Mode = Literal["all", "count", "percent"]
_SELECTOR = re.compile(r"^\s*(ALL|COUNT\((\d+)\)|PERCENT\((\d+(?:\.\d+)?)\))\s*$", re.IGNORECASE)


@runtime_checkable
class Target(Protocol):
    """One replica as chaos sees it; ``pid`` is None for a replica not running on this machine."""

    @property
    def replica_id(self) -> str: ...

    @property
    def zone(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def port(self) -> int: ...

    @property
    def admin_url(self) -> str: ...

    @property
    def admin_token(self) -> str | None: ...


def target_labels(target: Target) -> dict[str, str]:
    """The target's labels when it has any (``labels`` as pairs or a mapping), else none."""
    raw: object = getattr(target, "labels", ())
    if isinstance(raw, Mapping):
        return {str(k): str(v) for k, v in raw.items()}
    if isinstance(raw, Iterable):
        return {str(k): str(v) for k, v in raw}
    return {}


@dataclass(slots=True, frozen=True)
class Selector:
    """``ALL``, ``COUNT(n)`` or ``PERCENT(n)`` of the targets that pass the filters.

    Filters combine with AND; an empty filter passes everything. COUNT/PERCENT choose with a
    ``random.Random(seed)`` over the matching targets sorted by replica id, so a seeded selector always
    picks the same replicas from the same fleet. PERCENT rounds up: PERCENT(1) of three replicas is one.
    """

    mode: Mode = "all"
    n: float = 0
    replica_ids: frozenset[str] = frozenset()
    zones: frozenset[str] = frozenset()
    labels: tuple[tuple[str, str], ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.mode == "count" and (self.n < 1 or self.n != int(self.n)):
            raise ValueError(f"selector: COUNT(n) needs a whole n >= 1, got {self.n!r}")
        if self.mode == "percent" and not 0 < self.n <= 100:
            raise ValueError(f"selector: PERCENT(n) needs 0 < n <= 100, got {self.n!r}")

    @classmethod
    def parse(cls, text: str, *, replica_ids: Iterable[str] = (), zones: Iterable[str] = (),
              labels: Mapping[str, str] | None = None, seed: int | None = None) -> Selector:
        match = _SELECTOR.match(text)
        if match is None:
            raise ValueError(f"selector: expected ALL, COUNT(n) or PERCENT(n), got {text!r}")
        word = match.group(1).upper()
        mode: Mode = "all" if word == "ALL" else "count" if word.startswith("COUNT") else "percent"
        n = float(match.group(2) or match.group(3) or 0)
        return cls(mode=mode, n=n, replica_ids=frozenset(replica_ids), zones=frozenset(zones),
                   labels=tuple(sorted((labels or {}).items())), seed=seed)

    def matches(self, target: Target) -> bool:
        if self.replica_ids and target.replica_id not in self.replica_ids:
            return False
        if self.zones and target.zone not in self.zones:
            return False
        have = target_labels(target)
        return all(have.get(k) == v for k, v in self.labels)

    def resolve(self, targets: Sequence[Target]) -> tuple[Target, ...]:
        """The chosen targets, sorted by replica id; ValueError when the selector cannot be met."""
        pool = sorted((t for t in targets if self.matches(t)), key=lambda t: t.replica_id)
        if not pool:
            raise ValueError(f"selector: {self.describe()} matches none of {len(targets)} targets")
        if self.mode == "all":
            return tuple(pool)
        want = int(self.n) if self.mode == "count" else math.ceil(len(pool) * self.n / 100)
        if want > len(pool):
            raise ValueError(f"selector: {self.describe()} wants {want} targets, only {len(pool)} match")
        chosen = random.Random(self.seed).sample(pool, want)
        return tuple(sorted(chosen, key=lambda t: t.replica_id))

    def describe(self) -> str:
        head = {"all": "ALL", "count": f"COUNT({int(self.n)})", "percent": f"PERCENT({self.n:g})"}[self.mode]
        parts = [head]
        if self.replica_ids:
            parts.append(f"replica_id in {sorted(self.replica_ids)}")
        if self.zones:
            parts.append(f"zone in {sorted(self.zones)}")
        parts += [f"{k}={v}" for k, v in self.labels]
        return " where ".join([parts[0], " and ".join(parts[1:])]) if len(parts) > 1 else head
