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


SILENCE_REASONS = frozenset({"timeout", "stall"})  # no headers, or no token, within the stall timeout


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
    def is_silence(self) -> bool:
        """The replica went silent (no headers, or no token on any stream, within the stall timeout):
        moving the request off it spends no retry budget. Liveness moves every request waiting on a
        silent replica at once, and that batch is not the retry storm the budget guards against.
        Refusals, 5xx, error frames and resets spend it: there the replica ran the request, and a
        request that breaks replicas must not be carried to all of them."""
        return self.reason in SILENCE_REASONS

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




def too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body larger than {limit} bytes (gateway.max_body_bytes)",
                        type_="invalid_request_error", code="request_too_large", param="body")
