"""The API's gate: the token is checked before the body is read (no token and a malformed body is a 401,
a viewer's body on an operator route a 403, and a 30 MB upload without a token is refused before its body
is sent); then bodies over ``[api] max_body_bytes`` are a 413 in the OpenAI shape, from Content-Length
before reading, and while reading a chunked body."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from controlplane.config import ApiConfig, ConfigError, load_config
from controlplane.store.database import Store

from .conftest import Served, serve

SCALE = "/api/v1/fleet/scale"


def bearer(served: Served, role: str) -> dict[str, str]:
    return {"authorization": f"Bearer {served.token(role)}"}


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Served]:
    """The API with a 4 KiB body cap, as ``[api] max_body_bytes = 4096`` configures it."""
    config = tmp_path / "controlplane.toml"
    config.write_text("[api]\nmax_body_bytes = 4096\n")
    with Store(tmp_path / "state.db") as store:
        yield from serve(tmp_path, store, load_config(config).api)


def test_no_token_and_a_malformed_body_is_a_401(served: Served) -> None:
    answer = served.client.post(SCALE, content=b"{not json", headers={"content-type": "application/json"})
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_token"
    assert answer.headers["www-authenticate"] == "Bearer"


def test_a_viewers_malformed_body_on_an_operator_route_is_a_403(served: Served) -> None:
    answer = served.client.post(SCALE, content=b"{not json",
                                headers={**bearer(served, "viewer"), "content-type": "application/json"})
    assert answer.status_code == 403
    assert answer.json()["error"]["type"] == "permission_error"


def test_an_operators_malformed_body_is_a_400_naming_the_body(served: Served) -> None:
    answer = served.client.post(SCALE, content=b"{not json",
                                headers={**bearer(served, "operator"), "content-type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_a_declared_body_over_the_cap_is_a_413_in_the_openai_shape(small: Served) -> None:
    answer = small.client.post(SCALE, content=b'{"replicas": 3}' + b" " * 5000,
                               headers={**bearer(small, "operator"), "content-type": "application/json"})
    assert answer.status_code == 413
    assert answer.json() == {"error": {"message": "request body is 5015 bytes; the limit is 4096",
                                       "type": "invalid_request_error", "param": None,
                                       "code": "request_too_large"}}


def test_a_chunked_body_over_the_cap_is_cut_off_with_a_413(small: Served) -> None:
    sent = []

    def chunks() -> Iterator[bytes]:
        for _ in range(100):  # 100 KiB in 1 KiB chunks, no Content-Length
            sent.append(1)
            yield b" " * 1024

    answer = small.client.post(SCALE, content=chunks(),
                               headers={**bearer(small, "operator"), "content-type": "application/json"})
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "request_too_large"
    assert "exceeds the limit of 4096 bytes" in answer.json()["error"]["message"]


def test_a_body_under_the_cap_is_served(small: Served) -> None:
    answer = small.client.post(SCALE, json={"replicas": 3}, headers=bearer(small, "operator"))
    assert answer.status_code == 200 and answer.json() == {"desired_replicas": 3}


def test_the_cap_defaults_to_4_mib_and_a_nonsense_cap_fails_at_start(tmp_path: Path) -> None:
    assert ApiConfig().max_body_bytes == 4 << 20
    config = tmp_path / "controlplane.toml"
    config.write_text("[api]\nmax_body_bytes = 10\n")
    with pytest.raises(ConfigError, match=r"api\.max_body_bytes: must be in"):
        load_config(config)


# ---- on a real socket ------------------------------------------------------------------------------
@pytest.fixture
def listening(served: Served) -> Iterator[tuple[Served, int]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(served.app, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield served, port
    server.should_exit = True
    thread.join(10)


def head_only(port: int, headers: dict[str, str]) -> tuple[int, float]:
    """Send a POST whose headers declare a 30 MB body, send none of it, and read the answer's status."""
    lines = [f"POST {SCALE} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json",
             f"content-length: {30 * 1024 * 1024}", *(f"{k}: {v}" for k, v in headers.items())]
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        first = conn.recv(4096).split(b"\r\n", 1)[0]  # a timeout here: the server waits for the body
    return int(first.split()[1]), time.monotonic() - started


def test_a_30_mb_upload_without_a_token_is_refused_before_its_body_is_sent(
        listening: tuple[Served, int]) -> None:
    _, port = listening
    status, seconds = head_only(port, {})
    assert status == 401 and seconds < 2


def test_a_30_mb_upload_with_a_token_is_refused_from_its_content_length(
        listening: tuple[Served, int]) -> None:
    served, port = listening
    status, seconds = head_only(port, bearer(served, "operator"))
    assert status == 413 and seconds < 2
