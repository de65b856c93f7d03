"""Bad input never takes the gateway down: a real gateway process (``python -m controlplane.gateway``) in
front of a real replica gets oversized bodies (declared and streamed), deep nesting, huge numbers, invalid
UTF-8, NaN and infinities, non-ASCII keys and unknown fields. Each gets its 4xx in the OpenAI error shape,
never a 500; the gateway still serves afterwards and its memory grew by less than 50 MB over the suite,
run several times. A body over the limit is refused before it is read: a 64 MiB prompt never reaches the
gateway's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.process import write_config
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from inference.launcher import ReplicaProcess, free_port
from tests.polling import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "gateway-test-key"
LIMIT = 256 * 1024
MAX_RSS_GROWTH = 50 * 2**20
ROUNDS = 3
DEEP = 100_000


@dataclass(frozen=True)
class Case:
    name: str
    body: bytes
    status: int
    path: str = "/v1/completions"
    headers: dict[str, str | bytes] = field(default_factory=dict)


CASES = [
    Case("nested arrays", b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400),
    Case("nested chat", b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400, "/v1/chat/completions"),
    Case("5000-digit integer", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400),
    Case("5000-digit token id", b'{"prompt": [1, ' + b"7" * 5000 + b"]}", 400),
    Case("float overflow", b'{"prompt": "hi", "temperature": 1e999}', 400),
    Case("NaN", b'{"prompt": "hi", "temperature": NaN}', 400),
    Case("Infinity", b'{"prompt": "hi", "top_p": Infinity}', 400),
    Case("invalid UTF-8", b'{"prompt": "caf\xc3\x28 \xff\xfe"}', 400),
    Case("lone surrogate", b'{"prompt": "\\ud800 alone"}', 400),
    Case("unknown field", b'{"prompt": "hi", "max_tokens": 2, "frobnicate": 1}', 400),
    Case("not an object", b"[1, 2, 3]", 400),
    Case("truncated JSON", b'{"prompt": "hi"', 400),
    Case("empty body", b"", 400),
    Case("bad stream flag", b'{"prompt": "hi", "stream": "yes"}', 400),
    Case("bad priority header", b'{"prompt": "hi", "max_tokens": 2}', 400, headers={"x-priority": "vip"}),
    Case("over the limit", b'{"prompt": "' + b"a" * LIMIT + b'"}', 413),
    Case("non-ASCII key", b'{"prompt": "hi"}', 401, headers={"authorization": "Bearer ключ-🔑".encode()}),
    Case("latin-1 key", b'{"prompt": "hi"}', 401, headers={"authorization": b"Bearer caf\xe9"}),
    Case("no key", b'{"prompt": "hi"}', 401, headers={"authorization": b""}),
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, state_dir: Path) -> Iterator[tuple[str, int]]:
    tmp = tmp_path_factory.mktemp("gateway-bad-input")
    replica = ReplicaProcess(free_port(), replica_id="r0", zone="az-a", extra_args=("--num-threads", "1"),
                             env={"LLMSRE_STATE_DIR": str(state_dir)}, log_path=tmp / "r0.log").start()
    port = free_port()
    write_config(tmp / "config.json", GatewayConfig(api_keys=[KEY], max_body_bytes=LIMIT))
    endpoint = ReplicaEndpoint("r0", "az-a", "127.0.0.1", replica.port, ReplicaState.READY, "default")
    (tmp / "endpoints.json").write_text(json.dumps([endpoint.to_json()]))
    with open(tmp / "gateway.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "controlplane.gateway", "--port", str(port),
                                    "--config", str(tmp / "config.json"),
                                    "--endpoints", str(tmp / "endpoints.json")],
                                   stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        replica.wait_ready(120)
        wait_until(lambda: _healthy(port), timeout=60, what="the gateway to answer /health")
        # The gateway started before the replica answered, so it ejected r0 at its first probe; the cases
        # that reach the replica need it admitted again (its next /ready probe).
        wait_until(lambda: _routes(port), timeout=60, what="the gateway to route to r0")
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        process.wait(30)
        replica.stop()


def _routes(port: int) -> bool:
    ok = Case("valid", b'{"prompt": "hi", "max_tokens": 1}', 200)
    return _send(f"http://127.0.0.1:{port}", ok).status_code == 200


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _send(url: str, case: Case) -> httpx.Response:
    headers: dict[str, str | bytes] = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    headers.update(case.headers)
    return httpx.post(url + case.path, content=case.body, headers=headers, timeout=30)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_its_4xx_in_the_openai_shape(gateway: tuple[str, int], case: Case) -> None:
    response = _send(gateway[0], case)
    assert response.status_code == case.status, response.text[:300]
    error = response.json()["error"]
    assert error["message"] and error["type"]


def test_a_streamed_body_over_the_limit_is_cut_off_while_it_is_read(gateway: tuple[str, int]) -> None:
    """No Content-Length (chunked): the gateway stops reading at the limit."""
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(64 * 1024):  # 64 MiB in 1 KiB chunks, unless the gateway stops us first
            yield b"a" * 1024
        yield b'"}'

    before = psutil.Process(gateway[1]).memory_info().rss
    try:
        response = httpx.post(gateway[0] + "/v1/completions", content=chunks(), timeout=60,
                              headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})
        assert response.status_code == 413
    except httpx.HTTPError:
        pass  # the gateway answered 413 and closed while we were still sending: refused all the same
    assert psutil.Process(gateway[1]).memory_info().rss - before < MAX_RSS_GROWTH


def test_the_gateway_survives_the_suite_repeated_and_its_memory_stays_flat(gateway: tuple[str, int]) -> None:
    url, pid = gateway
    for case in CASES:  # warm-up: first-use allocations are not growth
        _send(url, case)
    before = psutil.Process(pid).memory_info().rss
    for _ in range(ROUNDS):
        for case in CASES:
            assert _send(url, case).status_code < 500
    time.sleep(0.5)
    grown = psutil.Process(pid).memory_info().rss - before
    assert grown < MAX_RSS_GROWTH, f"RSS grew {grown / 2**20:.1f} MiB"
    ok = httpx.post(url + "/v1/completions", json={"prompt": "still there?", "max_tokens": 4},
                    headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
