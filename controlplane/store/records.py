"""The store's document API: settings (one JSON value per key) and record collections (JSON documents).

Where it sits: features that keep whole documents write here through
:class:`controlplane.store.database.Store` (drills, autoscaler decisions, alerts, schedules, simulations
in ``records``; operator overrides and the fleet's desired state in ``kv``). Each write is durable when it
returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from controlplane.store.rows import Record, record_row, require_text
from controlplane.store.sqlite import (
    DEFAULT_LIMIT,
    SqliteDatabase,
    StoreNotFoundError,
    check_limit,
    is_row_id,
    to_json,
)


class RecordTables(SqliteDatabase):
    """The ``kv`` and ``records`` tables."""

    # -- settings ------------------------------------------------------------------------------
    def kv_put(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable value under ``key``, replacing any previous one."""
        require_text(key=key)
        body = to_json(value)
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
                               "VALUES (?, ?, ?, ?, ?)", (collection, key, stamp, now, to_json(doc)))
            record_id = cur.lastrowid
        assert record_id is not None
        return Record(record_id, collection, key, stamp, now, doc)

    def update_record(self, record_id: int, body: Mapping[str, Any]) -> Record:
        """Replace a document's body (its collection, key and ts stay)."""
        now, doc = self._clock(), dict(body)
        if not is_row_id(record_id):
            raise StoreNotFoundError(f"record {record_id} not found")
        with self._write("update record") as conn:
            cur = conn.execute("UPDATE records SET body = ?, updated = ? WHERE id = ?",
                               (to_json(doc), now, record_id))
            if cur.rowcount == 0:
                raise StoreNotFoundError(f"record {record_id} not found")
            row = conn.execute("SELECT * FROM records WHERE id = ?", (record_id,)).fetchone()
        return record_row(row)

    def record(self, record_id: int, collection: str | None = None) -> Record | None:
        """One document by id (``None`` when absent or in another collection)."""
        if not is_row_id(record_id):  # SQLite could not even bind it: no row has it
            return None
        rows = self._read("read record", "SELECT * FROM records WHERE id = ?", (record_id,))
        if not rows or (collection is not None and rows[0]["collection"] != collection):
            return None
        return record_row(rows[0])

    def records(self, collection: str, *, key: str | None = None, since: float | None = None,
                until: float | None = None, limit: int = DEFAULT_LIMIT,
                newest_first: bool = True) -> list[Record]:
        """Documents of ``collection`` (optionally one key, a ``ts`` range), newest first by default."""
        check_limit(limit)
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
