"""Retention: the store's tables that grow with use are trimmed in the background, in bounded batches.

Where it sits: ``controlplane up`` runs :meth:`Retention.run` beside its loops; each sweep runs in a worker
thread, off the API's event loop and off every request path. What is kept is ``[retention]``
(:class:`~controlplane.store.config.RetentionConfig`): the audit trail a year (at most a million rows),
events 30 days (a million rows), request traces 7 days (100,000 rows, also held on every insert), and
console session tokens until 7 days after they expired or were revoked. Each batch is its own short
transaction, so writers (a login, a trace) wait at most one batch.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

from controlplane.store.config import DAY_S, RetentionConfig
from controlplane.store.database import Store
from controlplane.store.sqlite import StoreError

logger = logging.getLogger(__name__)

# The console's session tokens, named "<user>/console-<hex>" by controlplane.api.auth; "/" is in no user or
# API token name, so API tokens (and the first admin's) are never purged: their hashes keep a revoked token
# from coming back through a stale environment variable.
SESSION_TOKENS = "%/console-%"


class Retention:
    """Trims ``audit``, ``events``, ``traces`` and old session tokens as ``config`` says."""

    def __init__(self, store: Store, config: RetentionConfig, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.config = store, config
        self._clock = clock

    def sweep(self) -> dict[str, int]:
        """Trim every table until it is within its bounds; how many rows each lost."""
        cfg, now = self.config, self._clock()
        deleted: dict[str, int] = {}
        for table, days, keep in (("audit", cfg.audit_days, cfg.audit_max_rows),
                                  ("events", cfg.events_days, cfg.events_max_rows),
                                  ("traces", cfg.traces_days, cfg.traces_max_rows)):
            before = now - days * DAY_S if days > 0 else None
            deleted[table] = self._repeat(functools.partial(self.store.trim_oldest, table, before=before,
                                                            keep=keep, batch=cfg.batch_rows))
        if cfg.sessions_days > 0:
            ended = now - cfg.sessions_days * DAY_S
            deleted["sessions"] = self._repeat(functools.partial(
                self.store.purge_tokens, name_like=SESSION_TOKENS, ended_before=ended, batch=cfg.batch_rows))
        if any(deleted.values()):
            logger.info("retention: deleted %s", ", ".join(f"{n} {t}" for t, n in deleted.items() if n))
        return deleted

    async def run(self) -> None:
        """Sweep every ``interval_s`` until cancelled; a failed sweep is logged and retried next time."""
        while True:
            try:
                await asyncio.to_thread(self.sweep)
            except StoreError as exc:
                logger.warning("retention: sweep failed, next in %.0fs: %s", self.config.interval_s, exc)
            await asyncio.sleep(self.config.interval_s)

    @staticmethod
    def _repeat(batch: Callable[[], int]) -> int:
        total = 0
        while (n := batch()) > 0:
            total += n
        return total
