"""In-memory stand-ins for the chaos unit tests: a ledger, a clock that only moves when told, targets and a
fault kind that records what it is asked to do."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chaos.faults.base import (
    Fault,
    FaultError,
    FaultKindInfo,
    FaultSpec,
    RevertFailed,
    RevertToken,
    check_params,
)
from chaos.safety import LedgerState
from chaos.targets import Target


@dataclass
class Row:
    id: int
    kind: str
    target: str
    params: dict[str, Any]
    state: LedgerState
    revert: dict[str, Any]
    detail: str = ""


class MemoryLedger:
    def __init__(self, events: list[str] | None = None) -> None:
        self.rows: dict[int, Row] = {}
        self.events = events if events is not None else []

    def register_fault(self, kind: str, target: str, params: Mapping[str, Any],
                       revert: Mapping[str, Any]) -> Row:
        row = Row(len(self.rows) + 1, kind, target, dict(params), "registered", dict(revert))
        self.rows[row.id] = row
        self.events.append(f"register:{row.id}")
        return row

    def mark_fault(self, fault_id: int, state: LedgerState, detail: str = "") -> Row:
        row = self.rows[fault_id]
        row.state, row.detail = state, detail
        self.events.append(f"mark:{fault_id}:{state}")
        return row

    def active_faults(self) -> list[Row]:
        return [r for r in self.rows.values() if r.state in ("registered", "injected", "revert_failed")]

    def state(self, fault_id: int) -> str:
        return self.rows[fault_id].state


class FakeClock:
    """``now()`` and ``sleep()`` on simulated time; ``advance()`` wakes the sleepers that are due."""

    def __init__(self) -> None:
        self.t = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.t + seconds, future))
        await future

    async def advance(self, seconds: float) -> None:
        await self._settle()  # tasks created before the jump start sleeping at the time they were made
        self.t += seconds
        due = [(t, f) for t, f in self._sleepers if t <= self.t]
        self._sleepers = [(t, f) for t, f in self._sleepers if t > self.t]
        for _, future in due:
            if not future.done():
                future.set_result(None)
        await self._settle()

    @staticmethod
    async def _settle() -> None:
        for _ in range(50):  # let ready tasks run to their next await
            await asyncio.sleep(0)


@dataclass(frozen=True)
class FakeTarget:
    replica_id: str
    zone: str = "az-a"
    pid: int | None = None
    port: int = 0
    admin_url: str = "http://127.0.0.1:1/admin/faults"
    admin_token: str | None = "admin"
    labels: tuple[tuple[str, str], ...] = ()


def fleet(n: int, zones: tuple[str, ...] = ("az-a", "az-b", "az-c")) -> list[Target]:
    return [FakeTarget(f"r{i}", zone=zones[i % len(zones)]) for i in range(n)]


@dataclass
class RecordingFault(Fault):
    """A fault kind that only records; ``revert_mode`` is ok, fail, fail_retryable or hang."""

    name: str = "record"
    takes_down: bool = False
    events: list[str] = field(default_factory=list)
    revert_mode: str = "ok"
    inject_fails: bool = False
    revert_delay_s: float = 0.0
    reverted: list[RevertToken] = field(default_factory=list)
    unavailable_reason: str | None = None

    def describe(self) -> FaultKindInfo:
        return FaultKindInfo(kind=self.name, family="test", description="records calls",
                             takes_down=self.takes_down, available=self.unavailable_reason is None,
                             unavailable_reason=self.unavailable_reason)

    def validate(self, spec: FaultSpec) -> None:
        check_params(spec, self.describe())

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        return RevertToken(self.name, target.replica_id, "record", {"stage": "registered"})

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        self.events.append(f"inject:{target.replica_id}")
        if self.inject_fails:
            raise FaultError(f"{target.replica_id}: refused")
        return RevertToken(self.name, target.replica_id, "record", {"stage": "injected"})

    async def revert(self, token: RevertToken) -> None:
        self.events.append(f"revert:{token.target}:{token.data['stage']}")
        if self.revert_mode == "hang":
            await asyncio.Event().wait()
        if self.revert_delay_s:
            await asyncio.sleep(self.revert_delay_s)
        if self.revert_mode in ("fail", "fail_retryable"):
            retryable = self.revert_mode == "fail_retryable"
            raise RevertFailed(f"{token.target}: cannot revert", retryable=retryable)
        self.reverted.append(token)
