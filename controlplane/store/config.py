"""The store's section of the configuration (``[retention]``): how long what grows with use is kept."""

from __future__ import annotations

from dataclasses import dataclass

DAY_S = 86_400.0


@dataclass(slots=True)
class RetentionConfig:
    """What the store keeps of the tables that grow with use; older rows are deleted in the background
    (``controlplane.store.retention``), in batches of ``batch_rows`` rows, every ``interval_s``.

    A row goes when it is older than its table's ``*_days`` or beyond its ``*_max_rows`` newest rows,
    whichever comes first; 0 days keeps rows of any age (the row bound still holds)."""

    audit_days: float = 365.0  # the audit trail: who did what (failed logins included)
    audit_max_rows: int = 1_000_000
    events_days: float = 30.0  # fleet, rollout, alert and gateway events
    events_max_rows: int = 1_000_000
    traces_days: float = 7.0  # per-request traces (the latency breakdown reads them)
    traces_max_rows: int = 100_000  # also held on every insert
    sessions_days: float = 7.0  # console session tokens, this long after they expired or were revoked
    interval_s: float = 600.0
    batch_rows: int = 1_000  # rows deleted per transaction: a sweep never holds the write lock for long


def retention_problems(cfg: RetentionConfig) -> list[tuple[str, str]]:
    """(key, reason) for every bad value of ``[retention]``."""
    problems: list[tuple[str, str]] = []
    for name in ("audit_days", "events_days", "traces_days", "sessions_days"):
        if getattr(cfg, name) < 0:
            problems.append((f"retention.{name}", "must be >= 0 (0: no age limit)"))
    for name in ("audit_max_rows", "events_max_rows", "traces_max_rows"):
        if getattr(cfg, name) < 1:
            problems.append((f"retention.{name}", "must be >= 1"))
    if not 1 <= cfg.interval_s <= DAY_S:
        problems.append(("retention.interval_s", "must be in [1, 86400]"))
    if not 1 <= cfg.batch_rows <= 100_000:
        problems.append(("retention.batch_rows", "must be in [1, 100000]"))
    return problems
