"""Refusals: every one is a plain HTTP error in the OpenAI shape, answered before any stream starts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .harness import ReplicaProcess, StartFresh, chat, completion, full_queue, openai_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ENDPOINTS = {"/v1/completions": completion, "/v1/chat/completions": chat}
BODY_LIMIT = 1 << 20  # the server's default max_body_bytes
JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(("field", "fields"), [
    ("temperature", {"temperature": -0.5}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": "ten"}),
    ("n", {"n": 2}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": {"text": "x"}}),
    ("min_tokens", {"min_tokens": 20, "max_tokens": 4}),
    ("priority", {"priority": "high"}),
])
def test_bad_parameter_is_a_400_naming_the_field(replica: ReplicaProcess, path: str, field: str,
                                                 fields: dict[str, Any]) -> None:
    response = replica.http.post(path, json=ENDPOINTS[path](**fields))

    error = openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field


def test_bad_parameter_with_stream_true_is_a_400_not_a_stream(replica: ReplicaProcess) -> None:
    response = replica.http.post("/v1/chat/completions", json=chat(temperature=-1, stream=True))

    assert openai_error(response, 400)["param"] == "temperature"


@pytest.mark.parametrize("path", ENDPOINTS)
def test_malformed_json_is_a_400_naming_the_body(replica: ReplicaProcess, path: str) -> None:
    response = replica.http.post(path, content=b'{"prompt": "hi",', headers=JSON)

    error = openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "body"


def test_prompt_as_long_as_the_context_is_context_length_exceeded(replica: ReplicaProcess) -> None:
    max_model_len = replica.http.get("/v1/models").json()["data"][0]["max_model_len"]

    just_fits = replica.http.post("/v1/completions", json=completion(prompt=[7] * (max_model_len - 1),
                                                                     max_tokens=1))
    too_long = replica.http.post("/v1/completions", json=completion(prompt=[7] * max_model_len))
    too_long_chat = replica.http.post("/v1/chat/completions", json=chat(
        messages=[{"role": "user", "content": "the " * max_model_len}], stream=True))

    assert just_fits.status_code == 200, just_fits.text
    for response in (too_long, too_long_chat):
        error = openai_error(response, 400)
        assert error["code"] == "context_length_exceeded"
        assert error["param"] == "prompt"
        assert str(max_model_len) in error["message"]


def test_out_of_vocabulary_token_is_a_400_but_not_context_length_exceeded(replica: ReplicaProcess) -> None:
    """A router that truncates prompts on ``context_length_exceeded`` must not be sent to do so here."""
    response = replica.http.post("/v1/completions", json=completion(prompt=[5, 10**9, 6]))

    error = openai_error(response, 400)
    assert error["param"] == "prompt"
    assert error["code"] != "context_length_exceeded"


@pytest.mark.parametrize("path", [*ENDPOINTS, "/v1/models"])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", "Basic cmVwbGljYQ=="])
def test_missing_or_wrong_api_key_is_a_401(replica: ReplicaProcess, path: str,
                                            authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    if path == "/v1/models":
        response = httpx.get(f"{replica.base_url}{path}", headers=headers)
    else:
        response = httpx.post(f"{replica.base_url}{path}", json=ENDPOINTS[path](), headers=headers)

    error = openai_error(response, 401)
    assert error["code"] == "invalid_api_key"


def test_body_over_the_limit_is_a_413_with_or_without_a_declared_length(replica: ReplicaProcess) -> None:
    body = b'{"prompt": "' + b"a" * BODY_LIMIT + b'", "max_tokens": 1}'

    def chunked() -> Iterator[bytes]:  # no Content-Length: the server must count while it reads
        for start in range(0, len(body), 64 * 1024):
            yield body[start:start + 64 * 1024]

    declared = replica.http.post("/v1/completions", content=body, headers=JSON)
    streamed = replica.http.post("/v1/completions", content=chunked(), headers=JSON)

    for response in (declared, streamed):
        assert openai_error(response, 413)["code"] == "request_too_large"
    assert replica.http.post("/v1/completions", json=completion()).status_code == 200


@pytest.mark.parametrize("path", ENDPOINTS)
def test_unknown_model_is_a_404(replica: ReplicaProcess, path: str) -> None:
    response = replica.http.post(path, json=ENDPOINTS[path](model="gpt-5"))

    error = openai_error(response, 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


def test_full_waiting_queue_is_a_429_with_retry_after_even_for_streams(start_fresh: StartFresh) -> None:
    replica = start_fresh("--max-num-seqs", "1", "--max-waiting-requests", "1", replica_id="queue")

    with full_queue(replica) as (running, waiting):
        plain = replica.http.post("/v1/completions", json=completion())
        streamed = replica.http.post("/v1/chat/completions", json=chat(stream=True))
        assert not waiting.events  # still waiting: the refusals above did not come from a free slot

    for response in (plain, streamed):
        error = openai_error(response, 429)
        assert error["type"] == "rate_limit_error"
        assert error["code"] == "queue_full"
        assert int(response.headers["retry-after"]) >= 1
    assert running.status == waiting.status == 200
    after = replica.http.post("/v1/completions", json=completion())
    assert after.status_code == 200, after.text
