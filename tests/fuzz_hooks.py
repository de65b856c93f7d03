"""Schemathesis hooks for the fuzz runs (loaded by ``schemathesis run`` through ``$SCHEMATHESIS_HOOKS``).

- Every response's status is counted, and the counts are written as JSON to ``$FUZZ_STATUS_FILE`` when the
  run ends, so a run reports how many responses had status 500 (not only how many distinct failures).
- Generated inference requests are capped at ``MAX_TOKENS`` new tokens: the fuzz aims at input handling,
  and a 2-core machine would otherwise spend minutes generating whole contexts. Integers above the cap are
  lowered and a missing or null limit set to it; any other value (a string, a negative number) is left for
  the server to refuse.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections import Counter
from typing import Any

import schemathesis

MAX_TOKENS = 8
CAPPED = ("max_tokens", "max_completion_tokens", "min_tokens")
STATUS_FILE_ENV = "FUZZ_STATUS_FILE"

_statuses: Counter[int] = Counter()
_lock = threading.Lock()


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    """Every phase's cases pass here before they are sent (``map_body`` misses the coverage phase's)."""
    if case.operation.path.startswith("/v1/") and isinstance(case.body, dict):
        cap_tokens(case.body)


def cap_tokens(body: dict[str, Any]) -> None:
    for name in CAPPED:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS
    limit = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"  # the one it reads
    if body.get(limit) is None:  # the server's default: a chat runs to the end of the context
        body[limit] = MAX_TOKENS


@schemathesis.hook
def after_call(context: schemathesis.HookContext, case: schemathesis.Case,
               response: schemathesis.Response) -> None:
    with _lock:
        _statuses[response.status_code] += 1


def _write() -> None:
    path = os.environ.get(STATUS_FILE_ENV)
    if path:
        with open(path, "w") as out:
            json.dump({str(k): v for k, v in sorted(_statuses.items())}, out)


atexit.register(_write)
