"""The Chaos Toolkit extension sends its token only to the control plane: every call is a path on the
configured URL, and a path that would leave it (an absolute URL, ``//host``) is refused before a byte goes
out. Two real loopback servers stand for the control plane and for a host the token must never reach.
Chaos Toolkit's own ``chaos discover`` lists the extension's actions and probes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from chaos import ctk

TOKEN = "ctk-operator-token-5b1e"


class Recording(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[int, str, str | None]]] = []  # (server port, path, Authorization)

    def do_GET(self) -> None:
        type(self).seen.append((self.server.server_address[1], self.path, self.headers.get("Authorization")))
        body = json.dumps({"ready_replicas": 3}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serve() -> Iterator[tuple[str, int]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def servers() -> Iterator[tuple[str, int, str, int]]:
    Recording.seen = []
    with serve() as (plane, plane_port), serve() as (other, other_port):
        yield plane, plane_port, other, other_port


def test_calls_go_to_the_control_plane_with_the_token(servers: tuple[str, int, str, int]) -> None:
    plane, plane_port, _, _ = servers
    assert ctk.ready_replicas({ctk.URL_KEY: plane}, {ctk.TOKEN_KEY: TOKEN}) == 3
    assert Recording.seen == [(plane_port, "/api/v1/fleet", f"Bearer {TOKEN}")]


@pytest.mark.parametrize("path", ["{other}/api/v1/fleet", "//127.0.0.1:{other_port}/api/v1/fleet",
                                  "api/v1/fleet", "/\\\\127.0.0.1:{other_port}/x"])
def test_a_path_that_would_leave_the_control_plane_is_refused_before_sending(
        servers: tuple[str, int, str, int], path: str) -> None:
    plane, _, other, other_port = servers
    target = path.format(other=other, other_port=other_port)
    with pytest.raises(ctk.ControlPlaneError, match="not a path on the control plane"):
        ctk._call("GET", target, {ctk.URL_KEY: plane}, {ctk.TOKEN_KEY: TOKEN})
    assert Recording.seen == []  # neither server saw a request, so the token went nowhere


CHAOS = Path(sys.executable).parent / "chaos"  # Chaos Toolkit's CLI, installed with the dev extras


def test_chaos_discover_lists_our_actions_and_probes(tmp_path: Path) -> None:
    done = subprocess.run([str(CHAOS), "--no-version-check", "--settings", str(tmp_path / "settings.yaml"),
                           "discover", "--no-system-info", "--no-install", "llm-sre-controlplane"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Discovery outcome saved in ./discovery.json" in done.stdout + done.stderr
    discovery = json.loads((tmp_path / "discovery.json").read_text())
    assert discovery["extension"]["name"] == "chaos.ctk" and discovery["system"] is None
    listed = [(a["type"], a["name"]) for a in discovery["activities"]]
    assert listed == [("action", name) for name in ctk.ACTIONS] + [("probe", name) for name in ctk.PROBES]
    assert {a["mod"] for a in discovery["activities"]} == {"chaos.ctk"}
    inject = discovery["activities"][0]
    assert inject["doc"].startswith("Inject a fault") and inject["return_type"] == "mapping"
    assert inject["arguments"][:3] == [{"name": "kind", "type": "string"},
                                       {"name": "duration_s", "default": 30.0, "type": "number"},
                                       {"name": "selector", "default": "COUNT(1)", "type": "string"}]
