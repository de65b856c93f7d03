"""An httpx transport that answers from an ASGI app in this process, for tests that drive the CLI or the
typed client against the control plane's API without a port (``controlplane.cli.main.main(argv,
transport=...)``, ``ControlPlaneClient(url, token, transport=...)``)."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient


class InProcess(httpx.BaseTransport):
    """Each request goes through Starlette's test client (which speaks its own copy of httpx, so its
    transport cannot be handed to ours directly)."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self.client.request(request.method, str(request.url), headers=dict(request.headers),
                                     content=request.read())
        return httpx.Response(answer.status_code, headers=list(answer.headers.multi_items()),
                              content=answer.content, request=request)
