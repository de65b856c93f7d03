"""The control plane's durable state: one SQLite file in WAL mode.

Where it sits: the fleet, the loops (reconcile, autoscaler, alerts, drills), chaos and the REST API write
here; the console reads it back through the API; a control plane restarted after a crash reads the
replica registry and the faults ledger to adopt or clean up what its predecessor left.

Durability: ``journal_mode=WAL`` with ``synchronous=FULL`` fsyncs the write-ahead log on every commit, so a
method that returned has its write on disk and it survives ``kill -9`` and power loss. Every write is one
``BEGIN IMMEDIATE`` transaction (the write lock is taken up front, so two processes never deadlock on a
lock upgrade) and ``busy_timeout`` lets a writer wait for another process instead of failing at once.

Threads: one connection guarded by a lock. SQLite serialises writers anyway, every statement here is a
short indexed read or a one-row write, and a single connection means ``close()`` really closes the file
(per-thread connections would leak one per worker thread of the API's pool until garbage collection) and
two threads can never interleave statements inside one transaction. Other processes (the CLI, a second
control plane) use their own ``Store`` and meet this one through SQLite's file locks.

Errors: every ``sqlite3`` error is translated in :func:`_translated` into :class:`StoreError` (or its
:class:`StoreConflictError` for constraint violations), keeping the original as ``__cause__``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from controlplane.replicas import ReplicaState
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
    record_row,
    redact,
    require_text,
    token_row,
    user_row,
)
from controlplane.traces import TraceRecord

log = logging.getLogger(__name__)

# The values live in controlplane.store.rows; they are importable from here as well.
__all__ = ["ACTIVE_FAULT_STATES", "DEFAULT_LIMIT", "DEFAULT_MAX_TRACE_ROWS", "FAULT_STATES", "OUTCOMES",
           "REDACTED", "SCHEMA_VERSION", "AuditRecord", "Event", "FaultRow", "FaultState", "Outcome",
           "Record", "ReplicaRow", "Store", "StoreConflictError", "StoreError", "StoreNotFoundError",
           "StorePragmas", "TokenRow", "UserRow", "redact"]

SCHEMA_VERSION = 2
DEFAULT_MAX_TRACE_ROWS = 100_000
TRACE_TRIM_BATCH = 1_000  # most trace rows deleted by one transaction, so a trim never holds the lock long
BUSY_TIMEOUT_MS = 5_000
DEFAULT_LIMIT = 500

# ---- errors ----------------------------------------------------------------------------------
class StoreError(Exception):
    """A database operation failed; ``__cause__`` holds the sqlite3 error when there was one."""


class StoreConflictError(StoreError):
    """A uniqueness constraint refused the write (a duplicate name, hash or key)."""


class StoreNotFoundError(StoreError):
    """The row to change does not exist."""


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """The one place where sqlite3 (and file system) errors become store errors."""
    try:
        yield
    except sqlite3.IntegrityError as exc:
        raise StoreConflictError(f"{what}: {exc}") from exc
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(f"{what}: {exc}") from exc


# ---- schema ----------------------------------------------------------------------------------
# _MIGRATIONS[i] takes a database from user_version i to i + 1. Statements are idempotent, so two
# processes opening a fresh file at once both succeed.
_SCHEMA_V1 = (
    """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, kind TEXT NOT NULL,
        subject TEXT NOT NULL, detail TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS events_kind ON events (kind, id)",
    "CREATE INDEX IF NOT EXISTS events_subject ON events (subject, id)",
    """CREATE TABLE IF NOT EXISTS replicas (
        replica_id TEXT PRIMARY KEY, zone TEXT NOT NULL, host TEXT NOT NULL, port INTEGER NOT NULL,
        pid INTEGER, state TEXT NOT NULL, model TEXT NOT NULL, generation INTEGER NOT NULL,
        started_at REAL NOT NULL, restarts INTEGER NOT NULL, updated REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS traces (
        id INTEGER PRIMARY KEY, request_id TEXT NOT NULL, started_at REAL NOT NULL,
        endpoint TEXT NOT NULL, model TEXT NOT NULL, status INTEGER NOT NULL, replica_id TEXT, zone TEXT,
        priority TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
        ttft_s REAL, e2e_s REAL NOT NULL, gateway_s REAL NOT NULL, queue_s REAL, prefill_s REAL,
        decode_s REAL, detokenize_s REAL, serialize_s REAL, retries INTEGER NOT NULL,
        resumes INTEGER NOT NULL, error TEXT, api_key_id TEXT)""",
    "CREATE INDEX IF NOT EXISTS traces_e2e ON traces (e2e_s)",
    "CREATE INDEX IF NOT EXISTS traces_started ON traces (started_at)",
    """CREATE TABLE IF NOT EXISTS audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, actor TEXT NOT NULL, role TEXT NOT NULL,
        action TEXT NOT NULL, target TEXT NOT NULL, params TEXT NOT NULL,
        outcome TEXT NOT NULL CHECK (outcome IN ('ok', 'denied', 'error')), detail TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS audit_actor ON audit (actor, id)",
    """CREATE TABLE IF NOT EXISTS tokens (
        id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, role TEXT NOT NULL,
        token_hash TEXT NOT NULL UNIQUE, created_at REAL NOT NULL, expires_at REAL, revoked_at REAL)""",
    # A name is unique among tokens that were not revoked, so a revoked name can be issued again.
    "CREATE UNIQUE INDEX IF NOT EXISTS tokens_live_name ON tokens (name) WHERE revoked_at IS NULL",
    """CREATE TABLE IF NOT EXISTS users (
        name TEXT PRIMARY KEY, password_hash TEXT NOT NULL, role TEXT NOT NULL, created_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS faults (
        id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, target TEXT NOT NULL,
        params TEXT NOT NULL, state TEXT NOT NULL
            CHECK (state IN ('registered', 'injected', 'reverted', 'revert_failed')),
        revert TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL, detail TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS faults_state ON faults (state)",
    """CREATE TABLE IF NOT EXISTS kv (
        key TEXT PRIMARY KEY, value TEXT NOT NULL, updated REAL NOT NULL)""",
)
# Version 2: documents for the features that keep whole JSON records (drills, decisions, alerts).
_SCHEMA_V2 = (
    """CREATE TABLE IF NOT EXISTS records (
        id INTEGER PRIMARY KEY AUTOINCREMENT, collection TEXT NOT NULL, key TEXT NOT NULL,
        ts REAL NOT NULL, updated REAL NOT NULL, body TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS records_collection ON records (collection, id)",
    "CREATE INDEX IF NOT EXISTS records_key ON records (collection, key, id)",
    "CREATE INDEX IF NOT EXISTS records_ts ON records (collection, ts)",
)
_MIGRATIONS: tuple[tuple[str, ...], ...] = (_SCHEMA_V1, _SCHEMA_V2)
assert len(_MIGRATIONS) == SCHEMA_VERSION

_TRACE_COLUMNS = tuple(f.name for f in dataclasses.fields(TraceRecord))
_REPLICA_COLUMNS = tuple(f.name for f in dataclasses.fields(ReplicaRow))


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _check_limit(limit: int) -> None:
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")


# ---- the store -------------------------------------------------------------------------------
class Store:
    """Typed access to the control plane's SQLite database; safe to share between threads."""

    def __init__(self, path: Path, *, max_rows: int = DEFAULT_MAX_TRACE_ROWS,
                 clock: Callable[[], float] = time.time) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.path = Path(path)
        self.max_rows = max_rows
        self._clock = clock
        self._lock = threading.Lock()
        self._conn = self._connect()
        self._trim_traces()

    # -- lifecycle -----------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        with _translated(f"open {self.path}"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: no implicit transactions; every write opens its own BEGIN IMMEDIATE.
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                   check_same_thread=False)
            try:
                conn.row_factory = sqlite3.Row
                conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(f"open {self.path}: SQLite refused WAL mode (journal_mode={mode})")
                conn.execute("PRAGMA synchronous = FULL")
                conn.execute("PRAGMA foreign_keys = ON")
                self._migrate(conn)
            except BaseException:
                conn.close()
                raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise StoreError(f"open {self.path}: schema version {version} is newer than this "
                                 f"control plane's ({SCHEMA_VERSION}); upgrade the control plane")
            for statements in _MIGRATIONS[version:]:
                for statement in statements:
                    conn.execute(statement)
            if version < SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                log.info("store %s: schema migrated from version %s to %s", self.path, version,
                         SCHEMA_VERSION)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock, _translated(f"close {self.path}"):
            self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def pragmas(self) -> StorePragmas:
        levels = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
        with self._lock, _translated("read pragmas"):
            def value(name: str) -> Any:
                return self._conn.execute(f"PRAGMA {name}").fetchone()[0]

            return StorePragmas(journal_mode=str(value("journal_mode")).lower(),
                                synchronous=levels.get(int(value("synchronous")), "?"),
                                busy_timeout_ms=int(value("busy_timeout")),
                                foreign_keys=bool(value("foreign_keys")),
                                user_version=int(value("user_version")))

    # -- plumbing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _write(self, what: str) -> Iterator[sqlite3.Connection]:
        """One write transaction; committed (and fsynced) when the block ends without error."""
        with self._lock, _translated(what):
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise

    def _read(self, what: str, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock, _translated(what):
            return self._conn.execute(sql, params).fetchall()

    # -- events --------------------------------------------------------------------------------
    def add_event(self, kind: str, subject: str, detail: Mapping[str, Any]) -> Event:
        require_text(kind=kind)
        ts, body = self._clock(), dict(detail)
        with self._write("add event") as conn:
            cur = conn.execute("INSERT INTO events (ts, kind, subject, detail) VALUES (?, ?, ?, ?)",
                               (ts, kind, subject, _dumps(body)))
            event_id = cur.lastrowid
        assert event_id is not None
        return Event(id=event_id, ts=ts, kind=kind, subject=subject, detail=body)

    def events(self, since_id: int = 0, kind_prefix: str | None = None, subject: str | None = None,
               limit: int = DEFAULT_LIMIT) -> list[Event]:
        """Events with an id above ``since_id``, oldest first (so a reader can follow the tail)."""
        _check_limit(limit)
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
        _check_limit(limit)
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
        _check_limit(limit)
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
                (stored.ts, stored.actor, stored.role, stored.action, stored.target, _dumps(stored.params),
                 stored.outcome, stored.detail))
            audit_id = cur.lastrowid
        return dataclasses.replace(stored, id=audit_id)

    def audit(self, limit: int = DEFAULT_LIMIT, actor: str | None = None,
              action_prefix: str | None = None) -> list[AuditRecord]:
        """Audit records, newest first."""
        _check_limit(limit)
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

    # -- tokens --------------------------------------------------------------------------------
    def add_token(self, name: str, role: str, token_hash: str, expires_at: float | None) -> TokenRow:
        """Store a token by its hash. A live (unrevoked) token of the same name is a conflict."""
        require_text(name=name, role=role, token_hash=token_hash)
        row = TokenRow(name=name, role=role, token_hash=token_hash, created_at=self._clock(),
                       expires_at=expires_at)
        with self._write(f"add token {name}") as conn:
            conn.execute("INSERT INTO tokens (name, role, token_hash, created_at, expires_at) "
                         "VALUES (?, ?, ?, ?, ?)", (name, role, token_hash, row.created_at, expires_at))
        return row

    def token_by_hash(self, token_hash: str) -> TokenRow | None:
        rows = self._read("read token", f"{_TOKEN_SELECT} WHERE token_hash = ?", (token_hash,))
        return token_row(rows[0]) if rows else None

    def revoke_token(self, name: str) -> bool:
        """Revoke the live token called ``name``; False when there is none."""
        with self._write(f"revoke token {name}") as conn:
            cur = conn.execute("UPDATE tokens SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
                               (self._clock(), name))
            return cur.rowcount > 0

    def tokens(self) -> list[TokenRow]:
        """Every token, revoked and expired ones included, oldest first."""
        return [token_row(r) for r in self._read("read tokens", f"{_TOKEN_SELECT} ORDER BY id")]

    # -- users ---------------------------------------------------------------------------------
    def add_user(self, name: str, password_hash: str, role: str) -> UserRow:
        require_text(name=name, password_hash=password_hash, role=role)
        row = UserRow(name=name, password_hash=password_hash, role=role, created_at=self._clock())
        with self._write(f"add user {name}") as conn:
            conn.execute("INSERT INTO users (name, password_hash, role, created_at) VALUES (?, ?, ?, ?)",
                         (name, password_hash, role, row.created_at))
        return row

    def user(self, name: str) -> UserRow | None:
        rows = self._read("read user", "SELECT * FROM users WHERE name = ?", (name,))
        return user_row(rows[0]) if rows else None

    def users(self) -> list[UserRow]:
        return [user_row(r) for r in self._read("read users", "SELECT * FROM users ORDER BY name")]

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
                (kind, target, _dumps(dict(params)), _dumps(dict(revert)), now, now))
            fault_id = cur.lastrowid
        assert fault_id is not None
        return FaultRow(id=fault_id, kind=kind, target=target, params=dict(params), state="registered",
                        revert=dict(revert), created=now, updated=now)

    def mark_fault(self, fault_id: int, state: FaultState, detail: str = "") -> FaultRow:
        if state not in FAULT_STATES:
            raise ValueError(f"state must be one of {', '.join(FAULT_STATES)}, got {state!r}")
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
        _check_limit(limit)
        rows = self._read("read faults", "SELECT * FROM faults ORDER BY id DESC LIMIT ?", (limit,))
        return [fault_row(r) for r in rows]

    # -- settings ------------------------------------------------------------------------------
    def kv_put(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable value under ``key``, replacing any previous one."""
        require_text(key=key)
        body = _dumps(value)
        with self._write(f"put setting {key}") as conn:
            conn.execute("INSERT INTO kv (key, value, updated) VALUES (?, ?, ?) "
                         "ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated = excluded.updated",
                         (key, body, self._clock()))

    def kv_get(self, key: str, default: Any = None) -> Any:
        rows = self._read("read setting", "SELECT value FROM kv WHERE key = ?", (key,))
        return json.loads(rows[0]["value"]) if rows else default

    # -- records -------------------------------------------------------------------------------
    def add_record(self, collection: str, body: Mapping[str, Any], key: str = "",
                   ts: float | None = None) -> Record:
        """Append a JSON document to ``collection``; durable when this returns."""
        require_text(collection=collection)
        now = self._clock()
        stamp, doc = (now if ts is None else ts), dict(body)
        with self._write(f"add {collection} record") as conn:
            cur = conn.execute("INSERT INTO records (collection, key, ts, updated, body) "
                               "VALUES (?, ?, ?, ?, ?)", (collection, key, stamp, now, _dumps(doc)))
            record_id = cur.lastrowid
        assert record_id is not None
        return Record(record_id, collection, key, stamp, now, doc)

    def update_record(self, record_id: int, body: Mapping[str, Any]) -> Record:
        """Replace a document's body (its collection, key and ts stay)."""
        now, doc = self._clock(), dict(body)
        with self._write("update record") as conn:
            cur = conn.execute("UPDATE records SET body = ?, updated = ? WHERE id = ?",
                               (_dumps(doc), now, record_id))
            if cur.rowcount == 0:
                raise StoreNotFoundError(f"record {record_id} not found")
            row = conn.execute("SELECT * FROM records WHERE id = ?", (record_id,)).fetchone()
        return record_row(row)

    def record(self, record_id: int, collection: str | None = None) -> Record | None:
        """One document by id (``None`` when absent or in another collection)."""
        rows = self._read("read record", "SELECT * FROM records WHERE id = ?", (record_id,))
        if not rows or (collection is not None and rows[0]["collection"] != collection):
            return None
        return record_row(rows[0])

    def records(self, collection: str, *, key: str | None = None, since: float | None = None,
                until: float | None = None, limit: int = DEFAULT_LIMIT,
                newest_first: bool = True) -> list[Record]:
        """Documents of ``collection`` (optionally one key, a ``ts`` range), newest first by default."""
        _check_limit(limit)
        where: list[str] = ["collection = ?"]
        params: list[Any] = [collection]
        for clause, value in (("key = ?", key), ("ts >= ?", since), ("ts < ?", until)):
            if value is not None:
                where.append(clause)
                params.append(value)
        order = "DESC" if newest_first else "ASC"
        rows = self._read(f"read {collection} records",
                          f"SELECT * FROM records WHERE {' AND '.join(where)} ORDER BY id {order} LIMIT ?",
                          [*params, limit])
        return [record_row(r) for r in rows]

    def trim_records(self, collection: str, keep: int) -> int:
        """Delete all but the newest ``keep`` documents of ``collection``; returns how many went."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        with self._write(f"trim {collection} records") as conn:
            cur = conn.execute("DELETE FROM records WHERE collection = ? AND id NOT IN (SELECT id FROM "
                               "records WHERE collection = ? ORDER BY id DESC LIMIT ?)",
                               (collection, collection, keep))
        return cur.rowcount


_TOKEN_SELECT = "SELECT name, role, token_hash, created_at, expires_at, revoked_at FROM tokens"
