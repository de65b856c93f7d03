"""The store keeps what it acknowledged: round trips of every table, its SQLite settings, the trace
bound, concurrent writers, redaction of secrets, and a real ``kill -9`` in the middle of writes."""

from __future__ import annotations

import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from controlplane.replicas import ReplicaState
from controlplane.store.database import (
    SCHEMA_VERSION,
    AuditRecord,
    ReplicaRow,
    Store,
    StoreConflictError,
    StoreError,
    StoreNotFoundError,
    redact,
)
from controlplane.traces import TraceRecord
from tests.controlplane.conftest import FakeClock

ROOT = Path(__file__).resolve().parents[3]




def trace(n: int, *, e2e_s: float = 1.0, replica_id: str | None = "r1", zone: str | None = "az-a"
          ) -> TraceRecord:
    return TraceRecord(request_id=f"req-{n}", started_at=100.0 + n, endpoint="/v1/completions",
                       model="default", status=200, replica_id=replica_id, zone=zone, priority="standard",
                       prompt_tokens=10, output_tokens=20, ttft_s=0.05, e2e_s=e2e_s, gateway_s=0.001,
                       queue_s=0.01, prefill_s=0.02, decode_s=0.5, detokenize_s=None, serialize_s=0.001,
                       retries=1, resumes=0, error=None, api_key_id="ab12")


# ---- settings ----------------------------------------------------------------------------------
def test_database_runs_in_wal_mode_with_full_sync(store: Store) -> None:
    pragmas = store.pragmas()
    assert pragmas.journal_mode == "wal"
    assert pragmas.synchronous == "FULL"
    assert pragmas.busy_timeout_ms >= 1000
    assert pragmas.foreign_keys is True
    assert pragmas.user_version == SCHEMA_VERSION
    with sqlite3.connect(store.path) as other:  # WAL is a property of the file, seen by every reader
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_reopening_keeps_data_and_schema(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with Store(path) as first:
        first.add_event("replica.spawned", "r1", {"port": 8101})
    with Store(path) as second:
        assert [e.subject for e in second.events()] == ["r1"]
        assert second.pragmas().user_version == SCHEMA_VERSION


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    Store(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer"):
        Store(path)


def test_sqlite_errors_become_store_errors_with_their_cause(store: Store) -> None:
    store.close()
    with pytest.raises(StoreError) as caught:
        store.events()
    assert isinstance(caught.value.__cause__, sqlite3.Error)


# ---- round trips -------------------------------------------------------------------------------
def test_events_round_trip_and_filter(store: Store, clock: FakeClock) -> None:
    spawned = store.add_event("replica.spawned", "r1", {"port": 8101, "zone": "az-a"})
    clock.now += 1
    store.add_event("replica.crashed", "r1", {"exit": -9})
    store.add_event("fleet.scaled", "fleet", {"to": 4})
    assert spawned.ts == 1_000.0 and spawned.detail == {"port": 8101, "zone": "az-a"}
    assert store.events()[0] == spawned
    assert [e.kind for e in store.events(kind_prefix="replica.")] == ["replica.spawned", "replica.crashed"]
    assert [e.kind for e in store.events(subject="fleet")] == ["fleet.scaled"]
    assert [e.kind for e in store.events(since_id=spawned.id)] == ["replica.crashed", "fleet.scaled"]
    assert len(store.events(limit=1)) == 1


def test_kind_prefix_is_literal_not_a_pattern(store: Store) -> None:
    store.add_event("replica_x", "r1", {})
    assert store.events(kind_prefix="replica%") == []
    assert store.events(kind_prefix="replica_") != []


def test_replica_registry_upserts_lists_and_deletes(store: Store) -> None:
    row = ReplicaRow(replica_id="r1", zone="az-a", host="127.0.0.1", port=8101, pid=4242,
                     state=ReplicaState.STARTING, model="default", generation=1, started_at=12.5, restarts=0)
    store.upsert_replica(row)
    store.upsert_replica(ReplicaRow(replica_id="r2", zone="az-b", host="127.0.0.1", port=8102, pid=None,
                                    state=ReplicaState.CRASHED, model="default"))
    ready = ReplicaRow(replica_id="r1", zone="az-a", host="127.0.0.1", port=8101, pid=4243,
                       state=ReplicaState.READY, model="default", generation=1, started_at=13.0, restarts=1)
    store.upsert_replica(ready)
    assert store.replicas()[0] == ready
    assert [r.replica_id for r in store.replicas()] == ["r1", "r2"]
    assert store.delete_replica("r2") is True
    assert store.delete_replica("r2") is False
    assert store.replicas() == [ready]


def test_replica_row_accepts_a_state_value_and_rejects_an_unknown_one() -> None:
    row = ReplicaRow(replica_id="r1", zone="az-a", host="h", port=1, pid=None,
                     state="ready", model="m")  # type: ignore[arg-type]
    assert row.state is ReplicaState.READY
    with pytest.raises(ValueError, match="sleeping"):
        ReplicaRow(replica_id="r1", zone="az-a", host="h", port=1, pid=None,
                   state="sleeping", model="m")  # type: ignore[arg-type]


def test_replica_row_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="port"):
        ReplicaRow(replica_id="r1", zone="az-a", host="h", port=0, pid=None, state=ReplicaState.READY,
                   model="m")
    with pytest.raises(ValueError, match="replica_id"):
        ReplicaRow(replica_id="", zone="az-a", host="h", port=1, pid=None, state=ReplicaState.READY,
                   model="m")


def test_traces_round_trip_slowest_first_with_filters(store: Store) -> None:
    records = [trace(1, e2e_s=0.5), trace(2, e2e_s=3.0, replica_id="r2", zone="az-b"), trace(3, e2e_s=2.0)]
    for record in records:
        store.add_trace(record)
    assert store.traces() == records  # every field survives, oldest first
    assert [t.e2e_s for t in store.slow_traces(limit=10)] == [3.0, 2.0, 0.5]
    assert [t.request_id for t in store.slow_traces(limit=1)] == ["req-2"]
    assert [t.request_id for t in store.slow_traces(limit=10, replica="r1")] == ["req-3", "req-1"]
    assert [t.request_id for t in store.slow_traces(limit=10, zone="az-b")] == ["req-2"]
    assert [t.request_id for t in store.slow_traces(limit=10, since=102.0)] == ["req-2", "req-3"]
    assert [t.request_id for t in store.traces(since=102.0, until=103.0)] == ["req-2"]


def test_a_version_2_database_gains_the_trace_id_and_keeps_its_traces(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with Store(path) as current:
        current.add_trace(trace(1))
    with sqlite3.connect(path) as conn:  # what a version-2 control plane left behind
        conn.execute("ALTER TABLE traces DROP COLUMN trace_id")
        conn.execute("PRAGMA user_version = 2")
    with Store(path) as upgraded:
        assert upgraded.pragmas().user_version == SCHEMA_VERSION
        assert upgraded.traces() == [trace(1)]  # the old row, without a trace id
        upgraded.add_trace(dataclasses.replace(trace(2), trace_id="4bf92f3577b34da6a3ce929d0e0e4736"))
        assert [t.trace_id for t in upgraded.slow_traces()] == [None, "4bf92f3577b34da6a3ce929d0e0e4736"]
    with sqlite3.connect(path) as conn:  # migrating again from an older version finds the column there
        conn.execute("PRAGMA user_version = 1")
    with Store(path) as again:
        assert len(again.traces()) == 2


def test_trace_bound_deletes_the_oldest(tmp_path: Path) -> None:
    with Store(tmp_path / "state.db", max_rows=50) as store:
        for n in range(230):
            store.add_trace(trace(n))
            assert store.count_traces() <= 50
        kept = [t.request_id for t in store.traces(limit=1000)]
    assert kept == [f"req-{n}" for n in range(180, 230)]


def test_lowering_the_trace_bound_trims_at_open(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with Store(path) as store:
        for n in range(40):
            store.add_trace(trace(n))
    with Store(path, max_rows=10) as store:
        assert store.count_traces() <= 10
        assert store.traces(limit=100)[-1].request_id == "req-39"


def test_audit_round_trip_newest_first_and_filtered(store: Store, clock: FakeClock) -> None:
    first = store.add_audit(AuditRecord(actor="alice", role="operator", action="fleet.scale",
                                        target="fleet", params={"replicas": 4}, outcome="ok"))
    clock.now += 1
    store.add_audit(AuditRecord(actor="bob", role="viewer", action="fleet.restart", target="r1",
                                params={}, outcome="denied", detail="needs operator"))
    store.add_audit(AuditRecord(actor="alice", role="operator", action="chaos.inject", target="r2",
                                params={"kind": "latency"}, outcome="error", detail="timeout"))
    assert first.id is not None and first.ts == 1_000.0
    assert [a.action for a in store.audit()] == ["chaos.inject", "fleet.restart", "fleet.scale"]
    assert store.audit()[-1] == first
    assert [a.action for a in store.audit(actor="alice")] == ["chaos.inject", "fleet.scale"]
    assert [a.action for a in store.audit(action_prefix="fleet.")] == ["fleet.restart", "fleet.scale"]
    assert len(store.audit(limit=1)) == 1


def test_audit_never_stores_a_secret_even_when_the_caller_forgot(store: Store) -> None:
    stored = store.add_audit(AuditRecord(actor="alice", role="admin", action="token.issue", target="ci",
                                         params={"admin_token": "s3cr3t-value"}, outcome="ok"))
    assert stored.params == {"admin_token": "***"}
    assert store.audit()[0].params == {"admin_token": "***"}


def test_audit_record_rejects_an_unknown_outcome() -> None:
    with pytest.raises(ValueError, match="outcome"):
        AuditRecord(actor="a", role="admin", action="x", target="y", params={}, outcome="maybe")  # type: ignore[arg-type]


def test_tokens_round_trip_and_revoke(store: Store, clock: FakeClock) -> None:
    store.add_token("ci", "operator", "h1", expires_at=2_000.0)
    store.add_token("ops", "admin", "h2", expires_at=None)
    row = store.token_by_hash("h1")
    assert row is not None and (row.name, row.role, row.expires_at, row.revoked_at) == \
        ("ci", "operator", 2_000.0, None)
    assert store.token_by_hash("nope") is None
    clock.now += 5
    assert store.revoke_token("ci") is True
    assert store.revoke_token("ci") is False
    revoked = store.token_by_hash("h1")
    assert revoked is not None and revoked.revoked_at == 1_005.0 and not revoked.is_active(clock.now)
    assert [t.name for t in store.tokens()] == ["ci", "ops"]


def test_a_live_token_name_is_unique_but_a_revoked_one_can_be_reused(store: Store) -> None:
    store.add_token("ci", "operator", "h1", expires_at=None)
    with pytest.raises(StoreConflictError):
        store.add_token("ci", "viewer", "h2", expires_at=None)
    with pytest.raises(StoreConflictError):
        store.add_token("other", "viewer", "h1", expires_at=None)
    store.revoke_token("ci")
    store.add_token("ci", "viewer", "h3", expires_at=None)
    assert [(t.name, t.token_hash) for t in store.tokens()] == [("ci", "h1"), ("ci", "h3")]


def test_users_round_trip(store: Store) -> None:
    alice = store.add_user("alice", "scrypt$hash", "operator")
    store.add_user("bob", "scrypt$other", "viewer")
    assert store.user("alice") == alice
    assert store.user("carol") is None
    assert [u.name for u in store.users()] == ["alice", "bob"]
    with pytest.raises(StoreConflictError):
        store.add_user("alice", "x", "admin")


def test_faults_ledger_tracks_states_until_reverted(store: Store, clock: FakeClock) -> None:
    fault = store.register_fault("replica.latency", "r1", {"per_token_ms": 50}, {"delete": "/admin/faults/7"})
    other = store.register_fault("process.kill", "r2", {}, {"respawn": True})
    assert fault.state == "registered" and fault.revert == {"delete": "/admin/faults/7"}
    clock.now += 2
    injected = store.mark_fault(fault.id, "injected", "ok")
    assert (injected.state, injected.detail, injected.updated, injected.created) == \
        ("injected", "ok", 1_002.0, 1_000.0)
    store.mark_fault(other.id, "revert_failed", "connection refused")
    assert [f.id for f in store.active_faults()] == [fault.id, other.id]
    store.mark_fault(fault.id, "reverted")
    assert [f.id for f in store.active_faults()] == [other.id]
    assert store.active_faults()[0].params == {}
    with pytest.raises(StoreNotFoundError):
        store.mark_fault(9999, "reverted")
    with pytest.raises(ValueError, match="state"):
        store.mark_fault(fault.id, "gone")  # type: ignore[arg-type]


def test_settings_round_trip_json(store: Store) -> None:
    assert store.kv_get("autoscaler", default={"mode": "off"}) == {"mode": "off"}
    store.kv_put("autoscaler", {"mode": "observe", "min": 1})
    store.kv_put("autoscaler", {"mode": "apply", "min": 2})
    store.kv_put("paused", True)
    assert store.kv_get("autoscaler") == {"mode": "apply", "min": 2}
    assert store.kv_get("paused") is True


# ---- redaction ---------------------------------------------------------------------------------
def test_redact_hides_secret_values_at_any_depth() -> None:
    params = {"replicas": 3, "api_key": "sk-1", "Password": "hunter2", "ADMIN_TOKEN": "t",
              "client_secret": "s", "nested": {"keys": ["k1", "k2"], "zone": "az-a"},
              "list": [{"token": "t2"}, "plain"], "authorization": "Bearer x"}
    assert redact(params) == {"replicas": 3, "api_key": "***", "Password": "***", "ADMIN_TOKEN": "***",
                              "client_secret": "***", "nested": {"keys": "***", "zone": "az-a"},
                              "list": [{"token": "***"}, "plain"], "authorization": "***"}
    assert params["api_key"] == "sk-1"  # a copy: the caller's dict is untouched


def test_redact_keeps_counts_under_token_names_but_hides_any_password() -> None:
    assert redact({"max_tokens": 64, "prompt_tokens": 10, "key_count": None, "password": 1234}) == \
        {"max_tokens": 64, "prompt_tokens": 10, "key_count": None, "password": "***"}


# ---- concurrency and durability ----------------------------------------------------------------
def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    shared, own = Store(path), Store(path)  # threads share one Store; one thread has its own connection
    per_thread, errors = 100, []

    def write(n: int, store: Store) -> None:
        try:
            for i in range(per_thread):
                store.add_event("load.tick", f"t{n}", {"i": i})
                store.add_trace(trace(n * 1000 + i))
        except Exception as exc:  # surfaced below: an exception in a thread would vanish
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n, own if n == 3 else shared)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    events = shared.events(limit=10_000)
    assert len(events) == len({e.id for e in events}) == 4 * per_thread
    for n in range(4):
        assert [e.detail["i"] for e in events if e.subject == f"t{n}"] == list(range(per_thread))
    assert shared.count_traces() == 4 * per_thread
    shared.close()
    own.close()


CHILD = """
import sys
from pathlib import Path
from controlplane.store.database import Store

store = Store(Path(sys.argv[1]))
i = 0
while True:
    event = store.add_event("durability.tick", "child", {"i": i})
    sys.stdout.write(f"{event.id}\\n")  # acknowledged: add_event returned, so the commit is on disk
    sys.stdout.flush()
    i += 1
"""


def test_acknowledged_writes_survive_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=ROOT, env=env, text=True)
    acknowledged: list[int] = []
    try:
        assert child.stdout is not None
        while len(acknowledged) < 300:
            line = child.stdout.readline()
            if not line:
                child.wait(timeout=10)
                pytest.fail(f"the writer exited early: {child.stderr.read() if child.stderr else ''}")
            acknowledged.append(int(line))
        child.send_signal(signal.SIGKILL)  # mid-loop: the child is writing the next events right now
    finally:
        child.kill()
        child.wait(timeout=10)
        for pipe in (child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()
    assert child.returncode == -signal.SIGKILL

    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with Store(path) as reopened:
        stored = {e.id for e in reopened.events(limit=1_000_000)}
    assert set(acknowledged) <= stored
    assert acknowledged == sorted(acknowledged)


# ---- records -----------------------------------------------------------------------------------
def test_records_round_trip_per_collection_and_key(store: Store, clock: FakeClock) -> None:
    first = store.add_record("drills", {"scenario": "replica-crash", "rto_s": 0.4}, key="d1")
    clock.now += 5
    store.add_record("drills", {"scenario": "zone-outage"}, key="d2")
    store.add_record("decisions", {"replicas": 4})
    assert [r.body["scenario"] for r in store.records("drills")] == ["zone-outage", "replica-crash"]
    assert [r.key for r in store.records("drills", newest_first=False)] == ["d1", "d2"]
    assert [r.id for r in store.records("drills", key="d1")] == [first.id]
    assert [r.key for r in store.records("drills", since=1_001.0)] == ["d2"]
    assert [r.key for r in store.records("drills", until=1_001.0)] == ["d1"]
    assert store.record(first.id) == first
    assert store.record(first.id, collection="decisions") is None


def test_update_record_keeps_its_timestamp_and_unknown_ids_fail(store: Store, clock: FakeClock) -> None:
    made = store.add_record("drills", {"state": "running"}, key="d1")
    clock.now += 30
    done = store.update_record(made.id, {"state": "passed"})
    assert (done.ts, done.updated, done.body) == (1_000.0, 1_030.0, {"state": "passed"})
    with pytest.raises(StoreNotFoundError):
        store.update_record(made.id + 100, {})


def test_trim_records_keeps_the_newest(store: Store) -> None:
    for n in range(5):
        store.add_record("decisions", {"n": n})
    store.add_record("drills", {"n": 0})
    assert store.trim_records("decisions", keep=2) == 3
    assert [r.body["n"] for r in store.records("decisions")] == [4, 3]
    assert len(store.records("drills")) == 1


def test_a_version_1_database_gains_the_records_table(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with Store(path) as current:
        current.kv_put("fleet.desired", 3)
    with sqlite3.connect(path) as conn:  # what a version-1 control plane left behind
        conn.execute("DROP TABLE records")
        conn.execute("PRAGMA user_version = 1")
    with Store(path) as upgraded:
        assert upgraded.pragmas().user_version == SCHEMA_VERSION
        assert upgraded.kv_get("fleet.desired") == 3
        assert upgraded.add_record("drills", {"ok": True}).body == {"ok": True}
