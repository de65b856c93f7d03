"""The plumbing of the typed REST client: one HTTP connection to the control plane, its errors and the
decoding of its answers.

Where it sits: under :mod:`controlplane.client`, whose :class:`~controlplane.client.ControlPlaneClient`
is a :class:`Connection` with a typed method per API call (and which re-exports every public name here:
the console imports the client only). HTTP and transport errors become :class:`ApiError` here, in one
place, with the server's message, error type and ``param``; :class:`Unreachable` (an ApiError without a
status) when no answer came at all. Answers become records of :mod:`controlplane.views` through
:meth:`Connection._one` and :meth:`Connection._many`; an answer of another shape is an ApiError too.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, Self, TypeVar

import httpx

from controlplane.errors import ControlPlaneError, Unavailable
from controlplane.views import UnexpectedAnswer, decode, decode_list

DEFAULT_URL = "http://127.0.0.1:8080"
TOKEN_ENV = "CONTROLPLANE_TOKEN"
T = TypeVar("T")


class ApiError(ControlPlaneError):
    """A refused or failed API call: ``status`` (None when no answer came), the server's error ``type``
    and ``param``, ``retry_after_s`` from a 503's Retry-After, and the ``request`` that failed."""

    def __init__(self, message: str, *, status: int | None = None, error_type: str | None = None,
                 param: str | None = None, retry_after_s: float | None = None,
                 request: httpx.Request | None = None) -> None:
        super().__init__(message, param=param)
        self.status, self.error_type, self.request = status, error_type, request
        self.retry_after_s = retry_after_s


class Unreachable(ApiError, Unavailable):
    """No answer: the control plane is down, or not at this address."""


class Availability(Protocol):
    """Told of every call's fate: an answer came (whatever its status), or none did. The console keeps its
    last data on screen and says since when the control plane is gone (``dashboards.session``)."""

    def answered(self) -> None: ...

    def unreachable(self, error: Unreachable) -> None: ...


class Connection:
    """An HTTP client of the control plane at ``url``, with the token given or in ``CONTROLPLANE_TOKEN``;
    ``transport`` replaces the network (tests), ``availability`` hears of every call's fate."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, *, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None,
                 availability: Availability | None = None) -> None:
        token = token or os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout, trust_env=False,
                                  transport=transport)
        self.availability = availability

    @property
    def url(self) -> str:
        return str(self._http.base_url)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _one(self, cls: type[T], method: str, path: str, **kwargs: Any) -> T:
        return self._decode(cls, self._call(method, path, **kwargs), path)

    def _many(self, cls: type[T], method: str, path: str, **kwargs: Any) -> list[T]:
        raw = self._call(method, path, **kwargs)
        try:
            return decode_list(cls, raw, cls.__name__)
        except UnexpectedAnswer as exc:
            raise self._unexpected(path, exc) from exc

    def _decode(self, cls: type[T], raw: object, where: str) -> T:
        try:
            return decode(cls, raw)
        except UnexpectedAnswer as exc:
            raise self._unexpected(where, exc) from exc

    def _unexpected(self, where: str, exc: UnexpectedAnswer) -> ApiError:
        return ApiError(f"unexpected answer from the control plane at {self.url} ({where}): {exc}")

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._send(method, path, **kwargs).json()

    def _text(self, method: str, path: str, **kwargs: Any) -> str:
        """Like ``_call`` for endpoints that answer plain text (a Prometheus rule file, Markdown)."""
        return self._send(method, path, **kwargs).text

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The one place where transport and HTTP errors become ApiError (the httpx error chained)."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            request = exc.request if isinstance(exc, httpx.RequestError) else None
            gone = Unreachable(f"cannot reach the control plane at {self.url}: {exc}", request=request)
            if self.availability is not None:
                self.availability.unreachable(gone)
            raise gone from exc
        if self.availability is not None:
            self.availability.answered()
        if response.status_code >= 400:
            raise _error(response)
        return response


def _error(response: httpx.Response) -> ApiError:
    try:
        body = response.json()
        error = body.get("error") if isinstance(body, dict) else None
    except ValueError:
        error = None
    error = error if isinstance(error, dict) else {}
    message = error.get("message") or response.text[:200]
    retry_after = response.headers.get("retry-after")
    return ApiError(f"HTTP {response.status_code}: {message}", status=response.status_code,
                    error_type=error.get("type"), param=error.get("param"),
                    retry_after_s=float(retry_after) if retry_after and retry_after.isdigit() else None,
                    request=response.request)
