"""The control plane's durable state: one SQLite file in WAL mode.

Where it sits: the fleet, the loops (reconcile, autoscaler, alerts, drills), chaos and the REST API write
here; the console reads it back through the API; a control plane restarted after a crash reads the
replica registry and the faults ledger to adopt or clean up what its predecessor left.

:class:`Store` is the one entry point. It holds the operational tables here (events, the replica registry,
request traces, the audit trail, the faults ledger) and takes the rest from its parts: tokens and users
(:mod:`controlplane.store.access`), settings and record collections (:mod:`controlplane.store.records`),
and the file itself, with its durability, threading and error translation (:mod:`controlplane.store.sqlite`).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from controlplane.replicas import ReplicaState
from controlplane.store.access import AccessTables
from controlplane.store.records import RecordTables
from controlplane.store.rows import (
    ACTIVE_FAULT_STATES,
    FAULT_STATES,
    OUTCOMES,
    REDACTED,
    AuditRecord,
    Event,
    FaultRow,
    FaultState,
    Outcome,
    Record,
    ReplicaRow,
    StorePragmas,
    TokenRow,
    UserRow,
    fault_row,
    redact,
    require_text,
)
from controlplane.store.sqlite import (
    DEFAULT_LIMIT,
    SCHEMA_VERSION,
    StoreConflictError,
    StoreError,
    StoreNotFoundError,
    check_limit,
    is_row_id,
    to_json,
)
from controlplane.traces import TraceRecord

# The values live in controlplane.store.rows and controlplane.store.sqlite; they are importable from here.
__all__ = ["ACTIVE_FAULT_STATES", "DEFAULT_LIMIT", "DEFAULT_MAX_TRACE_ROWS", "FAULT_STATES", "OUTCOMES",
           "REDACTED", "RETAINED", "SCHEMA_VERSION", "AuditRecord", "Event", "FaultRow", "FaultState",
           "Outcome", "Record", "ReplicaRow", "Store", "StoreConflictError", "StoreError",
           "StoreNotFoundError", "StorePragmas", "TokenRow", "UserRow", "redact"]

DEFAULT_MAX_TRACE_ROWS = 100_000
RETAINED = {"audit": "ts", "events": "ts", "traces": "started_at"}  # tables trimmed by age: their time column
TRACE_TRIM_BATCH = 1_000  # most trace rows deleted by one transaction, so a trim never holds the lock long

_TRACE_COLUMNS = tuple(f.name for f in dataclasses.fields(TraceRecord))
_REPLICA_COLUMNS = tuple(f.name for f in dataclasses.fields(ReplicaRow))


# ---- the store -------------------------------------------------------------------------------
class Store(RecordTables, AccessTables):
    """Typed access to the control plane's SQLite database; safe to share between threads."""

    def __init__(self, path: Path, *, max_rows: int = DEFAULT_MAX_TRACE_ROWS,
                 clock: Callable[[], float] = time.time) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        super().__init__(path, clock=clock)
        self._trim_traces()

    # -- events --------------------------------------------------------------------------------
    def add_event(self, kind: str, subject: str, detail: Mapping[str, Any]) -> Event:
        require_text(kind=kind)
        ts, body = self._clock(), dict(detail)
        with self._write("add event") as conn:
            cur = conn.execute("INSERT INTO events (ts, kind, subject, detail) VALUES (?, ?, ?, ?)",
                               (ts, kind, subject, to_json(body)))
            event_id = cur.lastrowid
        assert event_id is not None
        return Event(id=event_id, ts=ts, kind=kind, subject=subject, detail=body)

    def events(self, since_id: int = 0, kind_prefix: str | None = None, subject: str | None = None,
               limit: int = DEFAULT_LIMIT) -> list[Event]:
        """Events with an id above ``since_id``, oldest first (so a reader can follow the tail)."""
        check_limit(limit)
        where: list[str] = ["id > ?"]
        params: list[Any] = [since_id]
        if kind_prefix:
            where.append("substr(kind, 1, ?) = ?")
            params += [len(kind_prefix), kind_prefix]
        if subject is not None:
            where.append("subject = ?")
            params.append(subject)
        rows = self._read("read events", f"SELECT * FROM events WHERE {' AND '.join(where)} "
                                         "ORDER BY id LIMIT ?", [*params, limit])
        return [Event(id=r["id"], ts=r["ts"], kind=r["kind"], subject=r["subject"],
                      detail=json.loads(r["detail"])) for r in rows]

    # -- replicas ------------------------------------------------------------------------------
    def upsert_replica(self, row: ReplicaRow) -> None:
        values = [getattr(row, c) for c in _REPLICA_COLUMNS]
        values[_REPLICA_COLUMNS.index("state")] = row.state.value
        updates = ", ".join(f"{c} = excluded.{c}" for c in (*_REPLICA_COLUMNS[1:], "updated"))
        with self._write(f"upsert replica {row.replica_id}") as conn:
            conn.execute(f"INSERT INTO replicas ({', '.join(_REPLICA_COLUMNS)}, updated) "
                         f"VALUES ({', '.join('?' * (len(values) + 1))}) "
                         f"ON CONFLICT (replica_id) DO UPDATE SET {updates}", (*values, self._clock()))

    def replicas(self) -> list[ReplicaRow]:
        rows = self._read("read replicas", "SELECT * FROM replicas ORDER BY replica_id")
        try:
            return [ReplicaRow(**{c: r[c] for c in _REPLICA_COLUMNS if c != "state"},
                               state=ReplicaState(r["state"])) for r in rows]
        except ValueError as exc:
            raise StoreError(f"read replicas: a row does not parse: {exc}") from exc

    def delete_replica(self, replica_id: str) -> bool:
        with self._write(f"delete replica {replica_id}") as conn:
            return conn.execute("DELETE FROM replicas WHERE replica_id = ?", (replica_id,)).rowcount > 0

    # -- traces --------------------------------------------------------------------------------
    def add_trace(self, record: TraceRecord) -> None:
        """Keep one trace; beyond ``max_rows`` the oldest are deleted (in the same transaction)."""
        with self._write(f"add trace {record.request_id}") as conn:
            conn.execute(f"INSERT INTO traces ({', '.join(_TRACE_COLUMNS)}) "
                         f"VALUES ({', '.join('?' * len(_TRACE_COLUMNS))})",
                         [getattr(record, c) for c in _TRACE_COLUMNS])
            over = self._trim_step(conn)
        if over:
            self._trim_traces()

    def _trim_traces(self) -> None:
        """Trim until the bound holds, one bounded batch per transaction so others get the lock between."""
        over = True
        while over:
            with self._write("trim traces") as conn:
                over = self._trim_step(conn)

    def _trim_step(self, conn: sqlite3.Connection) -> bool:
        """Delete up to one batch of the oldest traces when over ``max_rows``; True while still over.

        Ids only grow and only the oldest are deleted, so max - min + 1 bounds the row count for two
        index lookups (count(*) would scan the table on every insert). Once over the bound, a trim makes
        room for ``batch`` more inserts, so deletes come once per batch instead of once per insert.
        """
        bounds = conn.execute("SELECT (SELECT min(id) FROM traces), (SELECT max(id) FROM traces)").fetchone()
        if bounds[0] is None:
            return False
        low, high = int(bounds[0]), int(bounds[1])
        if high - low + 1 <= self.max_rows:
            return False
        batch = min(TRACE_TRIM_BATCH, max(1, self.max_rows // 100))
        keep_from = high - self.max_rows + batch  # leaves max_rows - batch + 1 ids in the window
        cutoff = min(keep_from, low + TRACE_TRIM_BATCH)
        conn.execute("DELETE FROM traces WHERE id < ?", (cutoff,))
        return cutoff < keep_from

    def slow_traces(self, limit: int = 100, since: float | None = None, replica: str | None = None,
                    zone: str | None = None) -> list[TraceRecord]:
        """The slowest traces (end-to-end latency, descending), optionally since a time, on a replica or
        in a zone."""
        check_limit(limit)
        where: list[str] = ["1"]
        params: list[Any] = []
        for column, op, value in (("started_at", ">=", since), ("replica_id", "=", replica),
                                  ("zone", "=", zone)):
            if value is not None:
                where.append(f"{column} {op} ?")
                params.append(value)
        return self._select_traces(f"WHERE {' AND '.join(where)} ORDER BY e2e_s DESC, id LIMIT ?",
                                   [*params, limit])

    def traces(self, since: float | None = None, until: float | None = None,
               limit: int = DEFAULT_LIMIT) -> list[TraceRecord]:
        """Traces that started in [since, until), oldest first."""
        check_limit(limit)
        low = float("-inf") if since is None else since
        high = float("inf") if until is None else until
        return self._select_traces("WHERE started_at >= ? AND started_at < ? ORDER BY started_at, id "
                                   "LIMIT ?", [low, high, limit])

    def _select_traces(self, clause: str, params: Sequence[Any]) -> list[TraceRecord]:
        rows = self._read("read traces", f"SELECT {', '.join(_TRACE_COLUMNS)} FROM traces {clause}", params)
        return [TraceRecord(**{c: r[c] for c in _TRACE_COLUMNS}) for r in rows]

    def count_traces(self) -> int:
        return int(self._read("count traces", "SELECT count(*) FROM traces")[0][0])

    # -- audit ---------------------------------------------------------------------------------
    def add_audit(self, record: AuditRecord) -> AuditRecord:
        """Append one audit record (params redacted again here: secrets never reach the file)."""
        stored = dataclasses.replace(record, params=redact(record.params), ts=self._clock())
        with self._write(f"add audit {record.action}") as conn:
            cur = conn.execute(
                "INSERT INTO audit (ts, actor, role, action, target, params, outcome, detail) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (stored.ts, stored.actor, stored.role, stored.action, stored.target, to_json(stored.params),
                 stored.outcome, stored.detail))
            audit_id = cur.lastrowid
        return dataclasses.replace(stored, id=audit_id)

    def audit(self, limit: int = DEFAULT_LIMIT, actor: str | None = None,
              action_prefix: str | None = None) -> list[AuditRecord]:
        """Audit records, newest first."""
        check_limit(limit)
        where: list[str] = ["1"]
        params: list[Any] = []
        if actor is not None:
            where.append("actor = ?")
            params.append(actor)
        if action_prefix:
            where.append("substr(action, 1, ?) = ?")
            params += [len(action_prefix), action_prefix]
        rows = self._read("read audit", f"SELECT * FROM audit WHERE {' AND '.join(where)} "
                                        "ORDER BY id DESC LIMIT ?", [*params, limit])
        return [AuditRecord(actor=r["actor"], role=r["role"], action=r["action"], target=r["target"],
                            params=json.loads(r["params"]), outcome=r["outcome"], detail=r["detail"],
                            id=r["id"], ts=r["ts"]) for r in rows]

    # -- retention -----------------------------------------------------------------------------
    def trim_oldest(self, table: str, *, before: float | None, keep: int, batch: int) -> int:
        """Delete the oldest rows of ``table`` (one of :data:`RETAINED`) that are older than ``before`` or
        beyond its ``keep`` newest, at most ``batch`` of them in one short transaction; how many went.

        Rows are looked at oldest first (by id, which follows time) and deleted as a prefix, so a trim that
        finds nothing to do reads ``batch`` rows at most and takes no write lock."""
        column = RETAINED[table]
        if keep < 1 or batch < 1:
            raise ValueError(f"keep and batch must be >= 1, got {keep} and {batch}")
        rows = self._read(f"read oldest {table}", f"SELECT id, {column} AS at FROM {table} ORDER BY id "
                                                  "LIMIT ?", (batch,))
        if not rows:
            return 0
        high = int(self._read(f"read newest {table}", f"SELECT max(id) FROM {table}")[0][0])
        last = None
        for row in rows:
            if row["id"] > high - keep and (before is None or row["at"] >= before):
                break
            last = row["id"]
        if last is None:
            return 0
        with self._write(f"trim {table}") as conn:
            return int(conn.execute(f"DELETE FROM {table} WHERE id <= ?", (last,)).rowcount)

    # -- faults ledger -------------------------------------------------------------------------
    def register_fault(self, kind: str, target: str, params: Mapping[str, Any],
                       revert: Mapping[str, Any]) -> FaultRow:
        """Record a fault and how to revert it, before it is injected."""
        require_text(kind=kind, target=target)
        now = self._clock()
        with self._write(f"register fault {kind}") as conn:
            cur = conn.execute(
                "INSERT INTO faults (kind, target, params, state, revert, created, updated, detail) "
                "VALUES (?, ?, ?, 'registered', ?, ?, ?, '')",
                (kind, target, to_json(dict(params)), to_json(dict(revert)), now, now))
            fault_id = cur.lastrowid
        assert fault_id is not None
        return FaultRow(id=fault_id, kind=kind, target=target, params=dict(params), state="registered",
                        revert=dict(revert), created=now, updated=now)

    def mark_fault(self, fault_id: int, state: FaultState, detail: str = "") -> FaultRow:
        if state not in FAULT_STATES:
            raise ValueError(f"state must be one of {', '.join(FAULT_STATES)}, got {state!r}")
        if not is_row_id(fault_id):
            raise StoreNotFoundError(f"mark fault {fault_id}: no such fault")
        with self._write(f"mark fault {fault_id}") as conn:
            conn.execute("UPDATE faults SET state = ?, detail = ?, updated = ? WHERE id = ?",
                         (state, detail, self._clock(), fault_id))
            rows = conn.execute("SELECT * FROM faults WHERE id = ?", (fault_id,)).fetchall()
        if not rows:
            raise StoreNotFoundError(f"mark fault {fault_id}: no such fault")
        return fault_row(rows[0])

    def active_faults(self) -> list[FaultRow]:
        """Faults that may still be in place (registered, injected or failed to revert), oldest first."""
        marks = ", ".join("?" * len(ACTIVE_FAULT_STATES))
        rows = self._read("read faults", f"SELECT * FROM faults WHERE state IN ({marks}) ORDER BY id",
                          ACTIVE_FAULT_STATES)
        return [fault_row(r) for r in rows]

    def faults(self, limit: int = DEFAULT_LIMIT) -> list[FaultRow]:
        """The ledger, newest first."""
        check_limit(limit)
        rows = self._read("read faults", "SELECT * FROM faults ORDER BY id DESC LIMIT ?", (limit,))
        return [fault_row(r) for r in rows]


