"""Bad input never takes a replica down: oversized bodies, deep nesting, huge numbers, invalid UTF-8,
NaN and infinities, non-ASCII headers and unknown fields each get their 4xx in the OpenAI error shape
(never a 500), and after the whole suite, run several times, the replica still serves and its memory has
not grown by 50 MB.

Also here: a client that calls a replica directly cannot jump the queue ahead of its readiness probes
(``priority`` is clamped to the gateway's classes)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from inference.protocol import MAX_PRIORITY, MIN_PRIORITY, parse_completion

from .harness import API_KEY, ReplicaProcess, StartFresh, completion, openai_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BODY_LIMIT = 1 << 20  # the server's default max_body_bytes
JSON = {"content-type": "application/json"}
MAX_RSS_GROWTH = 50 * 2**20
ROUNDS = 3


@dataclass(frozen=True)
class Case:
    name: str
    body: bytes
    status: int
    says: str  # in the error message
    param: str | None = "body"
    path: str = "/v1/completions"
    headers: dict[str, str | bytes] = field(default_factory=dict)


def raw(text: str) -> bytes:
    return text.encode()


DEEP = 100_000
CASES = [
    Case("nested arrays", raw('{"prompt": ' + "[" * DEEP + "]" * DEEP + "}"), 400, "nested too deeply"),
    Case("nested objects", raw('{"a": ' * DEEP + "1" + "}" * DEEP), 400, "nested too deeply"),
    Case("nested chat", raw('{"messages": ' + "[" * DEEP + "]" * DEEP + "}"), 400, "nested too deeply",
         path="/v1/chat/completions"),
    Case("5000-digit integer", raw('{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}"), 400,
         "integer longer than 4300 digits"),
    Case("5000-digit token id", raw('{"prompt": [1, ' + "7" * 5000 + "]}"), 400,
         "integer longer than 4300 digits"),
    Case("4000-digit temperature", raw('{"prompt": "hi", "temperature": ' + "9" * 4000 + "}"), 400,
         "too large", param="temperature"),
    Case("4000-digit seed", raw('{"prompt": "hi", "temperature": 1, "seed": ' + "9" * 4000 + "}"), 400,
         "seed", param="seed"),
    Case("float overflow", raw('{"prompt": "hi", "temperature": 1e999}'), 400, "out of range"),
    Case("NaN", raw('{"prompt": "hi", "temperature": NaN}'), 400, "NaN is not a JSON number"),
    Case("Infinity", raw('{"prompt": "hi", "top_p": Infinity}'), 400, "Infinity is not a JSON number"),
    Case("-Infinity", raw('{"messages": [{"role": "user", "content": "hi"}], "temperature": -Infinity}'),
         400, "-Infinity is not a JSON number", path="/v1/chat/completions"),
    Case("invalid UTF-8", b'{"prompt": "caf\xc3\x28 \xff\xfe"}', 400, "not valid UTF-8"),
    Case("lone surrogate", raw('{"prompt": "\\ud800 alone"}'), 400, "lone surrogate"),
    Case("lone surrogate in chat", raw('{"messages": [{"role": "user", "content": "\\udfff"}]}'), 400,
         "lone surrogate", path="/v1/chat/completions"),
    Case("unknown field", raw('{"prompt": "hi", "frobnicate": 1}'), 400, "unrecognized request argument",
         param="frobnicate"),
    Case("unknown chat field", raw('{"messages": [{"role": "user", "content": "hi"}], "temprature": 0}'),
         400, "unrecognized request argument", param="temprature", path="/v1/chat/completions"),
    Case("not an object", raw("[1, 2, 3]"), 400, "must be a JSON object"),
    Case("truncated JSON", raw('{"prompt": "hi"'), 400, "not valid JSON"),
    Case("empty body", b"", 400, "not valid JSON"),
    Case("over the size limit", raw('{"prompt": "' + "a" * BODY_LIMIT + '"}'), 413, "limit", param=None),
    Case("non-ASCII bearer", raw('{"prompt": "hi"}'), 401, "invalid API key", param=None,
         headers={"Authorization": "Bearer ключ-🔑".encode()}),
    Case("latin-1 bearer", raw('{"prompt": "hi"}'), 401, "invalid API key", param=None,
         headers={"Authorization": b"Bearer caf\xe9"}),
    Case("non-ASCII bearer on /v1/models", b"", 401, "invalid API key", param=None, path="/v1/models",
         headers={"Authorization": "Bearer ü".encode()}),
    Case("non-ASCII admin token", b"", 401, "invalid admin token", param=None, path="/admin/faults",
         headers={"Authorization": "Bearer ädmin".encode()}),
]


def send(replica: ReplicaProcess, case: Case) -> httpx.Response:
    headers: dict[str, str | bytes] = {**JSON, "Authorization": f"Bearer {API_KEY}", **case.headers}
    method = "GET" if case.path in ("/v1/models", "/admin/faults") else "POST"
    with httpx.Client(base_url=replica.base_url, timeout=30) as client:
        return client.request(method, case.path, content=case.body if method == "POST" else None,
                              headers=headers)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_its_4xx_in_the_openai_shape(replica: ReplicaProcess, case: Case) -> None:
    response = send(replica, case)

    error = openai_error(response, case.status)
    assert case.says.lower() in error["message"].lower(), error
    if case.param is not None:
        assert error["param"] == case.param, error
    assert replica.is_running


def test_body_declared_over_the_limit_is_refused_before_it_is_read(replica: ReplicaProcess) -> None:
    """A 1 GiB Content-Length is answered at once: the server does not wait for (or buffer) the body."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {1 << 30}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", replica.port), timeout=10) as sock:
        sock.sendall(head + b'{"prompt": "')
        started = time.monotonic()
        answer = b""
        while b"request_too_large" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer and time.monotonic() - started < 5


def test_the_body_limit_is_configurable(start_fresh: StartFresh) -> None:
    replica = start_fresh("--max-body-bytes", "4096", replica_id="small-bodies")
    fits = replica.http.post("/v1/completions", json=completion(prompt="a " * 1000, max_tokens=1))
    over = replica.http.post("/v1/completions", json=completion(prompt="a " * 2100, max_tokens=1))

    assert fits.status_code == 200, fits.text
    error = openai_error(over, 413)
    assert error["code"] == "request_too_large" and "4096" in error["message"]


def test_a_direct_client_cannot_jump_ahead_of_readiness_probes() -> None:
    """The scheduler serves lower priorities first and readiness probes go at -2**31: a client's own
    priority is clamped to the gateway's classes (interactive 0 .. batch 2)."""
    for asked, kept in ((-(2**40), MIN_PRIORITY), (-5, MIN_PRIORITY), (1, 1), (10**4000, MAX_PRIORITY)):
        assert parse_completion({"prompt": "hi", "priority": asked}).priority == kept


def test_the_replica_stays_healthy_and_small_through_the_whole_suite(replica: ReplicaProcess) -> None:
    ok = replica.http.post("/v1/completions", json=completion(max_tokens=2))  # warm, then measure
    assert ok.status_code == 200, ok.text
    before = rss_bytes(replica.proc.pid)
    for _ in range(ROUNDS):
        for case in CASES:
            assert send(replica, case).status_code == case.status, case.name
    grown = rss_bytes(replica.proc.pid) - before

    assert replica.is_running
    assert replica.http.get("/health").status_code == 200
    assert replica.http.get("/ready").status_code == 200
    after = replica.http.post("/v1/completions", json=completion(max_tokens=2))
    assert after.status_code == 200, after.text
    assert grown < MAX_RSS_GROWTH, f"RSS grew by {grown / 2**20:.1f} MiB over {ROUNDS} rounds"
    print(f"RSS grew by {grown / 2**20:.1f} MiB over {ROUNDS} rounds of {len(CASES)} bad requests")
