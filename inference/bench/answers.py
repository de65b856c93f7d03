"""What the load client makes of a server's answers: each chunk folded into the request's record, each
failure classified (HTTP status, the OpenAI error object, the transport's exception), and Retry-After read.

Where it sits: :mod:`inference.bench.load_client` sends the requests and calls these on what comes back; the
record and the error kinds are :mod:`inference.bench.report`'s.
"""

from __future__ import annotations

import json
import time
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from inference.bench.report import (
    CONNECT_ERROR,
    PROTOCOL_ERROR,
    STREAM_CUT,
    TIMEOUT,
    RequestRecord,
    ServerTimings,
    http_error_kind,
)


def absorb_chunk(record: RequestRecord, chunk: dict[str, Any], now: float) -> None:
    """Fold one SSE chunk into ``record``: a token arrival when it carries text or token ids."""
    record.response_id = record.response_id or _str_or_none(chunk.get("id"))
    carries_token = False
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        carries_token |= bool(choice.get("text") or delta.get("content") or choice.get("token_ids"))
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    if carries_token:
        record.token_times.append(now)
        if record.first_token_time is None:
            record.first_token_time = now
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        record.completion_tokens = _int_or_none(usage.get("completion_tokens"))
    if "timings" in chunk:
        record.timings = ServerTimings.from_json(chunk["timings"]) or record.timings


def fail(record: RequestRecord, kind: str, *, message: str | None = None) -> None:
    if record.error_kind is None:  # the first failure is the cause; later ones are its echoes
        record.error_kind, record.error_message = kind, message


def fail_http(record: RequestRecord, status: int, body: bytes) -> None:
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        parsed = None
    if isinstance(parsed, dict) and "error" in parsed:
        fail_with_error_object(record, http_error_kind(status), parsed["error"])
    else:
        detail = parsed.get("detail") if isinstance(parsed, dict) else None
        message = str(detail) if detail else body[:500].decode(errors="replace")
        fail(record, http_error_kind(status), message=message)


def fail_with_error_object(record: RequestRecord, kind: str, error: object) -> None:
    """The OpenAI error shape: ``{"message", "type", "code", "param"}``."""
    err = error if isinstance(error, dict) else {"message": str(error)}
    fail(record, kind, message=_str_or_none(err.get("message")))
    record.error_type = _str_or_none(err.get("type"))
    record.error_code = _str_or_none(err.get("code"))


def error_kind(exc: Exception) -> str:
    """Translate transport exceptions into error kinds (the one place that knows httpx's tree)."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return CONNECT_ERROR
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return TIMEOUT
    if isinstance(exc, httpx.TransportError):
        return STREAM_CUT  # connected, then the connection broke before [DONE]
    return PROTOCOL_ERROR


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: a number of seconds or an HTTP date; None when absent or unreadable."""
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
