"""The replica's HTTP API over raw HTTP: models, stage timings, the replica header, extension fields."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import httpx
import pytest

from inference.bench.datasets import DatasetConfig
from inference.bench.load_client import run_load
from inference.bench.load_config import LoadConfig

from .harness import API_KEY, DONE, MODEL, ReplicaProcess, chat, completion, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STAGES = ("queue", "prefill", "decode", "detokenize", "serialize")
ENDPOINTS = {"completion": ("/v1/completions", completion), "chat": ("/v1/chat/completions", chat)}


def _assert_timings(timings: dict[str, Any], replica: ReplicaProcess) -> None:
    assert timings["replica"] == replica.replica_id
    assert timings["zone"] == replica.zone
    for stage in STAGES:
        assert isinstance(timings[stage], float) and timings[stage] >= 0.0, (stage, timings)
    assert timings["prefill"] > 0.0 and timings["decode"] > 0.0  # a forward pass takes time


def _stream(replica: ReplicaProcess, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    with replica.http.stream("POST", path, json={**body, "stream": True}) as response:
        return response, list(sse_events(response))


def test_models_lists_the_served_model_with_its_context_length(replica: ReplicaProcess) -> None:
    response = replica.http.get("/v1/models")

    assert response.status_code == 200
    [model] = response.json()["data"]
    assert model["id"] == MODEL and model["object"] == "model"
    assert isinstance(model["max_model_len"], int) and model["max_model_len"] > 0


@pytest.mark.parametrize("kind", ENDPOINTS)
def test_non_streaming_response_carries_stage_timings_of_this_replica(replica: ReplicaProcess,
                                                                      kind: str) -> None:
    path, body = ENDPOINTS[kind]

    response = replica.http.post(path, json=body())

    assert response.status_code == 200
    assert response.headers["x-replica-id"] == replica.replica_id
    _assert_timings(response.json()["timings"], replica)


@pytest.mark.parametrize(("kind", "include_usage"), list(itertools.product(ENDPOINTS, [False, True])))
def test_final_stream_chunk_carries_stage_timings_of_this_replica(replica: ReplicaProcess, kind: str,
                                                                  include_usage: bool) -> None:
    path, body = ENDPOINTS[kind]

    response, events = _stream(replica, path, body(stream_options={"include_usage": include_usage}))

    assert response.status_code == 200
    assert response.headers["x-replica-id"] == replica.replica_id
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == DONE
    *chunks, final = events[:-1]
    _assert_timings(final["timings"], replica)
    assert all("timings" not in c for c in chunks)
    if include_usage:
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 8
    else:
        assert final["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("method", "path", "body", "auth"), [
    ("GET", "/health", None, True),
    ("GET", "/ready", None, True),
    ("GET", "/metrics", None, True),
    ("GET", "/v1/models", None, True),
    ("GET", "/v1/models", None, False),  # 401
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, True),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, True),  # 400
    ("POST", "/v1/chat/completions", {"messages": [], "max_tokens": 2}, True),  # 400
    ("GET", "/no/such/route", None, True),  # 404
])
def test_every_response_carries_the_replica_id_header(replica: ReplicaProcess, method: str, path: str,
                                                      body: dict[str, Any] | None, auth: bool) -> None:
    headers = replica.auth if auth else {}

    response = httpx.request(method, f"{replica.base_url}{path}", json=body, headers=headers, timeout=30)

    assert response.headers.get("x-replica-id") == replica.replica_id, (response.status_code, response.text)


def test_top_k_one_samples_the_greedy_text(replica: ReplicaProcess) -> None:
    greedy = replica.http.post("/v1/completions", json=completion(max_tokens=16, temperature=0.0))
    top_1 = replica.http.post("/v1/completions", json=completion(max_tokens=16, temperature=1.0, top_k=1,
                                                                 seed=3))

    assert top_1.status_code == 200
    assert top_1.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_null_top_k_means_top_k_disabled(replica: ReplicaProcess) -> None:
    body = completion(max_tokens=16, temperature=1.0, seed=3)
    disabled = replica.http.post("/v1/completions", json={**body, "top_k": -1})
    null = replica.http.post("/v1/completions", json={**body, "top_k": None})

    assert null.status_code == 200, null.text
    assert null.json()["choices"][0]["text"] == disabled.json()["choices"][0]["text"]


def test_priority_field_is_accepted(replica: ReplicaProcess) -> None:
    response = replica.http.post("/v1/chat/completions", json=chat(priority=-5))

    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 8


def _eos_seed(replica: ReplicaProcess, max_tokens: int) -> tuple[int, dict[str, Any]]:
    """A seed whose sample ends at an end-of-sequence token before ``max_tokens`` (16 does today)."""
    for seed in itertools.chain([16], range(64)):
        body = completion(prompt="hi", max_tokens=max_tokens, temperature=1.0, seed=seed)
        out = replica.http.post("/v1/completions", json=body).json()
        if out["choices"][0]["finish_reason"] == "stop":
            return seed, out
    raise AssertionError("no seed in range(64) ends at an end-of-sequence token")


def test_ignore_eos_and_min_tokens_generate_past_the_end_of_sequence(replica: ReplicaProcess) -> None:
    seed, stopped = _eos_seed(replica, max_tokens=24)
    natural = stopped["usage"]["completion_tokens"]
    assert natural < 24

    ignoring = replica.http.post("/v1/completions", json=completion(
        prompt="hi", max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)).json()
    at_least = replica.http.post("/v1/completions", json=completion(
        prompt="hi", max_tokens=24, temperature=1.0, seed=seed, min_tokens=natural + 2)).json()

    assert ignoring["usage"]["completion_tokens"] == 24
    assert ignoring["choices"][0]["finish_reason"] == "length"
    assert ignoring["choices"][0]["text"].startswith(stopped["choices"][0]["text"])
    assert at_least["usage"]["completion_tokens"] >= natural + 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stream_resumed_from_its_token_ids_equals_the_undisturbed_stream(replica: ReplicaProcess,
                                                                         temperature: float) -> None:
    """What a gateway does when a replica dies mid-stream: continue elsewhere from the ids already sent."""
    body = completion(prompt="Resume me", max_tokens=20, temperature=temperature, seed=7, ignore_eos=True,
                      return_token_ids=True)
    _, events = _stream(replica, "/v1/completions", body)
    chunks = [e for e in events if e is not DONE]
    prompt_ids = chunks[0]["prompt_token_ids"]
    full = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert len(full) == 20

    sent = full[:7]
    resumed = completion(prompt=prompt_ids + sent, max_tokens=13, temperature=temperature, seed=7,
                         ignore_eos=True, output_offset=7, return_token_ids=True)
    response = replica.http.post("/v1/completions", json=resumed)

    assert response.status_code == 200
    assert sent + response.json()["choices"][0]["token_ids"] == full


@pytest.mark.parametrize("token_ids", [False, True])
def test_the_load_client_counts_every_token_when_it_asks_for_token_ids(replica: ReplicaProcess,
                                                                       token_ids: bool) -> None:
    """The bundled random model often streams a token whose text is still empty (a byte of a character):
    such a chunk carries no text, so a client timing visible text sees its first token late and several
    tokens at once. With ``--token-ids`` every token is timed when it arrives, as the simulator and the
    replica's own TTFT count them."""
    cfg = LoadConfig(DatasetConfig(num_requests=4, input_len=24, output_len=48, seed=3),
                     base_url=replica.base_url, api_key=API_KEY, token_ids=token_ids)
    report = asyncio.run(run_load(cfg))
    ok = [r for r in report.records if r.is_success]
    assert len(ok) == 4 and all(r.completion_tokens == 48 for r in ok), report.records
    arrivals = [len(r.token_times) for r in ok]
    if token_ids:
        assert arrivals == [48] * 4
    else:  # what the same requests look like timed by their text: tokens arrive in clumps
        assert sum(arrivals) < 4 * 48, arrivals
