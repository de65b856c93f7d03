"""Retention: the audit trail, events and traces lose what is older than their ``[retention]`` days or beyond
their row bound, and console session tokens go some days after they ended, in batches that each hold the
write lock briefly; API tokens and the first admin's are never purged. On a simulated clock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.auth import Auditor, Principal, Role, TokenAuthority
from controlplane.config import ConfigError, load_config
from controlplane.store.config import DAY_S, RetentionConfig
from controlplane.store.database import Store
from controlplane.store.retention import Retention
from controlplane.traces import TraceRecord


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[Store]:
    with Store(tmp_path / "state.db", clock=clock) as opened:
        yield opened


def audit(store: Store, n: int, action: str = "fleet.scale") -> None:
    auditor = Auditor(store)
    for i in range(n):
        auditor.record(Principal("ops", Role.OPERATOR), action, f"t{i}", {}, "ok")


def trace(i: int, at: float) -> TraceRecord:
    return TraceRecord(request_id=f"r{i}", started_at=at, endpoint="/v1/completions", model="default",
                       status=200, replica_id="az-a-1", zone="az-a", priority="standard", prompt_tokens=8,
                       output_tokens=8, ttft_s=0.1, e2e_s=0.2, gateway_s=0.01, queue_s=0.0, prefill_s=0.05,
                       decode_s=0.1, detokenize_s=0.0, serialize_s=0.0, retries=0, resumes=0, error=None,
                       api_key_id=None)


def test_rows_older_than_their_days_go_and_newer_ones_stay(store: Store, clock: Clock) -> None:
    audit(store, 5, "old.audit")
    for i in range(5):
        store.add_event("old.event", "fleet", {})
        store.add_trace(trace(i, clock.now))
    clock.now += 40 * DAY_S
    audit(store, 3, "new.audit")
    store.add_event("new.event", "fleet", {})
    store.add_trace(trace(99, clock.now))
    deleted = Retention(store, RetentionConfig(audit_days=30, events_days=30, traces_days=30),
                        clock=clock).sweep()
    assert deleted == {"audit": 5, "events": 5, "traces": 5, "sessions": 0}
    assert {a.action for a in store.audit(limit=100)} == {"new.audit"}
    assert [e.kind for e in store.events()] == ["new.event"]
    assert [t.request_id for t in store.traces()] == ["r99"]


def test_a_table_keeps_at_most_its_newest_rows(store: Store, clock: Clock) -> None:
    audit(store, 25)
    Retention(store, RetentionConfig(audit_max_rows=10, batch_rows=3), clock=clock).sweep()
    kept = store.audit(limit=100)
    assert [a.target for a in kept] == [f"t{i}" for i in range(24, 14, -1)]


def test_a_trim_deletes_at_most_one_batch_per_transaction(store: Store, clock: Clock) -> None:
    audit(store, 25)
    clock.now += 2 * DAY_S
    assert store.trim_oldest("audit", before=clock.now - DAY_S, keep=1000, batch=7) == 7
    assert len(store.audit(limit=100)) == 18


def test_zero_days_keeps_rows_of_any_age(store: Store, clock: Clock) -> None:
    audit(store, 4)
    clock.now += 10_000 * DAY_S
    Retention(store, RetentionConfig(audit_days=0), clock=clock).sweep()
    assert len(store.audit(limit=100)) == 4


def test_ended_sessions_go_after_their_days_and_api_tokens_never(store: Store, clock: Clock) -> None:
    tokens = TokenAuthority(store, clock=clock)
    tokens.ensure_admin(None)
    tokens.issue("ci-bot", Role.OPERATOR, ttl_s=60)  # an API token that expired: kept (refuses its reuse)
    tokens.issue("alice/console-a1b2c3", Role.OPERATOR, ttl_s=60)  # a session that expired
    tokens.issue("bob/console-d4e5f6", Role.VIEWER, ttl_s=3600)
    tokens.revoke("bob/console-d4e5f6")  # logged out
    live = tokens.issue("carol/console-0a0b0c", Role.VIEWER, ttl_s=30 * DAY_S)
    clock.now += 8 * DAY_S
    deleted = Retention(store, RetentionConfig(sessions_days=7), clock=clock).sweep()
    assert deleted["sessions"] == 2
    assert sorted(t.name for t in store.tokens()) == ["bootstrap-admin", "carol/console-0a0b0c", "ci-bot"]
    assert tokens.verify(live) is not None


def test_retention_is_configured_in_its_own_section(tmp_path: Path) -> None:
    config = tmp_path / "controlplane.toml"
    config.write_text("[retention]\naudit_days = 90\nevents_max_rows = 5000\n")
    loaded = load_config(config).retention
    assert (loaded.audit_days, loaded.events_max_rows, loaded.traces_days) == (90.0, 5000, 7.0)
    config.write_text("[retention]\nbatch_rows = 0\n")
    with pytest.raises(ConfigError, match=r"retention\.batch_rows"):
        load_config(config)
