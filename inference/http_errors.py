"""A replica's refusals in the OpenAI error shape: :class:`HTTPError` and the JSON response it becomes.

Where it sits: :mod:`inference.server` raises it for every check a request fails before its stream starts
(API key, body, parameters, draining, device failure, injected errors, prompt length, queue room) and
for the admin routes; :mod:`inference.response_writer` raises it when a non-streamed request fails in
the engine. The app's exception handler (:func:`inference.server.create_app`) answers it with
:meth:`HTTPError.response`.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from inference.protocol import error_body


class HTTPError(Exception):
    """A refusal in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, type_: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = error_body(self.message, type_=self.type, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)
