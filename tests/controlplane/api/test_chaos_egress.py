"""The experiments endpoint fences its http providers: a host named in ``[chaos] experiment_hosts`` is
reached, any other is refused with the rule named, and nothing arrives there. The API runs in this process
(its experiments run on its own loop); the two hosts are real loopback servers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

from fastapi.testclient import TestClient

from chaos.catalogue import Catalogue
from chaos.safety import FaultManager
from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.reconcile import Fleet
from controlplane.store.database import Store
from tests.chaos.fakes import RecordingFault
from tests.controlplane.fleet.test_reconcile import SimBackend


class Host(BaseHTTPRequestHandler):
    seen: ClassVar[list[int]] = []  # the ports that received a request

    def do_GET(self) -> None:
        type(self).seen.append(self.server.server_address[1])
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Host)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def probe(name: str, url: str) -> dict[str, Any]:
    return {"type": "probe", "name": name, "provider": {"type": "http", "url": url, "timeout": 5}}


def test_configured_hosts_are_reached_and_no_other(tmp_path: Path) -> None:
    Host.seen = []
    with host() as configured, host() as other, Store(tmp_path / "state.db") as store:
        fleet = Fleet(FleetConfig(replicas=0), SimBackend(), store, secret=b"s" * 32)
        tokens = TokenAuthority(store)
        services = Services(fleet, store, tokens, Auditor(store),
                            chaos=FaultManager(Catalogue([RecordingFault()]), store),
                            experiment_hosts=(configured,))
        headers = {"Authorization": f"Bearer {tokens.issue('op', Role.OPERATOR)}"}
        with TestClient(create_api(services)) as client:
            started = client.post("/api/v1/chaos/experiments", headers=headers, json={"experiment": {
                "title": "egress", "description": "one allowed host, one not",
                "method": [probe("configured", f"http://{configured}/status"),
                           probe("other", f"http://{other}/status")]}})
            assert started.status_code == 202, started.text
            path = f"/api/v1/chaos/experiments/{started.json()['id']}"
            deadline = time.monotonic() + 30
            while (journal := client.get(path, headers=headers).json())["status"] == "running":
                assert time.monotonic() < deadline, journal
                time.sleep(0.1)
    reached, refused = journal["run"]
    assert reached["status"] == "succeeded" and reached["output"]["status"] == 204
    assert refused["status"] == "failed"
    assert f"{other} is not an allowed host for experiments" in refused["exception"][-1]
    assert Host.seen == [int(configured.rsplit(":", 1)[1])]
