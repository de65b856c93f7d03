"""What the gateway refuses a client with, and how an upstream replica failed: one exception tree."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from inference.protocol import error_body

logger = logging.getLogger(__name__)


# ---- errors ----------------------------------------------------------------------------------
class GatewayError(Exception):
    """A refusal the client gets as an OpenAI-shaped error (or as an error frame mid-stream)."""

    def __init__(self, status: int, message: str, *, type_: str, code: str | None = None,
                 param: str | None = None, headers: Mapping[str, str] | None = None,
                 body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})
        self.body = body or error_body(message, type_=type_, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


FAILOVER_REASONS = frozenset({"connect", "timeout", "stall", "broken"})


class UpstreamError(Exception):
    """One attempt on one replica failed: connect error, timeout, HTTP error, stall, broken stream."""

    def __init__(self, replica_id: str, reason: str, message: str, *, status: int | None = None,
                 body: Any = None, retry_after: str | None = None) -> None:
        super().__init__(f"replica {replica_id}: {message}")
        self.replica_id, self.reason, self.status = replica_id, reason, status
        self.body, self.retry_after = body, retry_after

    @property
    def is_retryable(self) -> bool:
        """Another replica may succeed: transport failures, 5xx and 429 (a 4xx is the request's fault)."""
        return self.status is None or self.status >= 500 or self.status == 429

    @property
    def is_failover(self) -> bool:
        """The replica is not serving at all (refused the connection, sent no headers in time, went
        silent, reset before a token): trying another one moves work off a dead replica rather than
        adding any, so it spends no retry budget. Answers from a working replica (5xx, 429, error frames)
        are retries, and do."""
        return self.reason in FAILOVER_REASONS

    @property
    def is_failure(self) -> bool:
        """Counts toward ejection: the replica is broken, not merely busy (429) or refusing (4xx)."""
        return self.status is None or self.status >= 500

    def to_client(self, retry_after_s: int) -> GatewayError:
        """What the client gets when no other replica is left to try."""
        if self.status is not None and isinstance(self.body, dict) and "error" in self.body:
            headers = {"Retry-After": self.retry_after} if self.retry_after else {}
            return GatewayError(self.status, str(self), type_="server_error", headers=headers, body=self.body)
        return GatewayError(503, f"no replica could serve the request; last failure: {self}",
                            type_="service_unavailable", code="upstream_unavailable",
                            headers={"Retry-After": str(retry_after_s)})


def bad_request(param: str, message: str) -> GatewayError:
    return GatewayError(400, f"{param}: {message}", type_="invalid_request_error", param=param)


