"""The store's SQLite file: opening it (WAL, private mode), the schema and its migrations, transactions,
and the one place where sqlite3 errors become store errors.

Where it sits: under the tables of :mod:`controlplane.store.database` (events, replicas, traces, audit,
faults), :mod:`controlplane.store.access` (tokens, users) and :mod:`controlplane.store.records` (settings,
record collections), which all write through :meth:`SqliteDatabase._write` and read through
:meth:`SqliteDatabase._read`.

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
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self

from controlplane.errors import Conflict, ControlPlaneError, NotFound
from controlplane.store.files import restrict, touch_private
from controlplane.store.rows import StorePragmas

log = logging.getLogger(__name__)

SCHEMA_VERSION = 4
BUSY_TIMEOUT_MS = 5_000
WAL_SUFFIXES = ("-wal", "-shm")  # SQLite's files next to the database in WAL mode
DEFAULT_LIMIT = 500
MAX_ROW_ID = 2**63 - 1  # SQLite's largest INTEGER: a larger id given as a query parameter cannot be bound


# ---- errors ----------------------------------------------------------------------------------
class StoreError(ControlPlaneError):
    """A database operation failed; ``__cause__`` holds the sqlite3 error when there was one."""


class StoreConflictError(StoreError, Conflict):
    """A uniqueness constraint refused the write (a duplicate name, hash or key)."""


class StoreNotFoundError(StoreError, NotFound):
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


def _add_column(table: str, column: str, declaration: str) -> Callable[[sqlite3.Connection], None]:
    """ALTER TABLE ... ADD COLUMN, made idempotent as the other steps are (SQLite has no IF NOT EXISTS)."""
    def add(conn: sqlite3.Connection) -> None:
        if column not in {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
    return add


# Version 3: a request's OpenTelemetry trace id, so that the console names the trace of a slow request.
_SCHEMA_V3 = (_add_column("traces", "trace_id", "TEXT"),)
# Version 4: a canary replica's version, so that a restarted control plane adopts it as the canary's.
_SCHEMA_V4 = (_add_column("replicas", "version", "TEXT NOT NULL DEFAULT ''"),)
_MIGRATIONS: tuple[tuple[str | Callable[[sqlite3.Connection], None], ...], ...] = (
    _SCHEMA_V1, _SCHEMA_V2, _SCHEMA_V3, _SCHEMA_V4)
assert len(_MIGRATIONS) == SCHEMA_VERSION


def to_json(value: Any) -> str:
    """A stored JSON text: sorted keys and no spaces, so equal values are equal texts."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def is_row_id(value: int) -> bool:
    """Whether ``value`` fits SQLite's INTEGER (a larger one, from a URL, would fail to bind)."""
    return -MAX_ROW_ID - 1 <= value <= MAX_ROW_ID


def check_limit(limit: int) -> None:
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")


# ---- the file --------------------------------------------------------------------------------
class SqliteDatabase:
    """One SQLite file behind one connection and a lock; safe to share between threads."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._conn = self._connect()

    # -- lifecycle -----------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        with _translated(f"open {self.path}"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Token and password hashes live here: 0600 before SQLite first opens it (its -wal and -shm
            # files take the database's mode), and older files narrowed.
            touch_private(self.path)
            for suffix in WAL_SUFFIXES:
                restrict(self.path.with_name(self.path.name + suffix))
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
                    if isinstance(statement, str):
                        conn.execute(statement)
                    else:
                        statement(conn)
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

    def __enter__(self) -> Self:
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
