"""The gateway's stitched stream carries the logprobs of every token exactly once, in the client's shape,
even when a chat resumes as a completion of token ids on another replica. No processes: upstream chunks
are built as a replica builds them (:mod:`inference.logprobs`)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.gateway.assembly import PATHS, RequestParams, StreamAssembly
from inference.logprobs import LogprobEntry, chat_logprobs, completion_logprobs

# One alternative per token, more likely than the chosen token: the completions map then holds both, and
# reading it back must keep only the alternative.
TOKENS = [LogprobEntry(f"t{i}", -1.5 - i, ((f"u{i}", -0.5 - i),)) for i in range(6)]
PROMPT_IDS = [1, 2, 3]
HELD = 3


def _text(index: int) -> str:
    """As a detokenizer holds back part of a character: token 3's text comes out with token 4's."""
    return {HELD: "", HELD + 1: TOKENS[HELD].token + TOKENS[HELD + 1].token}.get(index, TOKENS[index].token)


def _chunk(kind: str, index: int, *, first: bool = False, last: bool = False) -> dict[str, Any]:
    entry = [TOKENS[index]]
    if kind == "chat":
        choice: dict[str, Any] = {"delta": {"content": _text(index)}, "logprobs": chat_logprobs(entry)}
    else:  # a completion, or a chat resumed as one
        choice = {"text": _text(index), "logprobs": completion_logprobs(entry)}
    choice.update(index=0, token_ids=[100 + index], finish_reason="length" if last else None)
    chunk: dict[str, Any] = {"id": "x", "object": "chunk", "created": 1, "model": "m", "choices": [choice]}
    if first:
        chunk["prompt_token_ids"] = PROMPT_IDS + [100 + i for i in range(index)]
    return chunk


def _body(kind: str) -> dict[str, Any]:
    common = {"max_tokens": len(TOKENS), "temperature": 0, "presence_penalty": 1.0,
              "repetition_penalty": 1.2}
    if kind == "chat":
        return {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1,
                **common}
    return {"prompt": "hi", "logprobs": 1, **common}


def _client_logprobs(kind: str, chunks: list[dict[str, Any]]) -> list[Any]:
    found: list[Any] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            lp = choice["logprobs"]
            found.extend(lp["content"] if kind == "chat" else zip(lp["tokens"], lp["token_logprobs"],
                                                                   lp["top_logprobs"], lp["text_offset"]))
    return found


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stream_resumed_mid_way_shows_each_tokens_logprobs_once(kind: str) -> None:
    params = RequestParams.parse(kind, _body(kind))
    undisturbed = StreamAssembly(params)
    want = [c for i in range(len(TOKENS))
            for c in undisturbed.accept(_chunk(kind, i, first=i == 0, last=i == len(TOKENS) - 1))]
    want += undisturbed.closing_chunks()

    broken = StreamAssembly(params)
    got = [c for i in range(HELD + 1) for c in broken.accept(_chunk(kind, i, first=i == 0))]
    path, body = broken.continuation(priority=1)
    # Greedy (temperature 0): it goes on from the last checkpoint, before the held token, and what it
    # regenerates is dropped, logprobs included.
    done = body["output_offset"]
    assert done == HELD
    assert path == PATHS["completion"] and body["logprobs"] == 1
    assert body["presence_penalty"] == 1.0 and body["repetition_penalty"] == 1.2
    for i in range(done, len(TOKENS)):
        got += broken.accept(_chunk("completion", i, first=i == done, last=i == len(TOKENS) - 1))
    got += broken.closing_chunks()

    assert _client_logprobs(kind, got) == _client_logprobs(kind, want)
    assert len(_client_logprobs(kind, got)) == len(TOKENS)
    whole = undisturbed.full_response()["choices"][0]["logprobs"]
    assert broken.full_response()["choices"][0]["logprobs"] == whole
    first = _client_logprobs(kind, got)[0]
    if kind == "chat":
        assert first == {"token": "t0", "logprob": -1.5, "bytes": [116, 48],
                         "top_logprobs": [{"token": "u0", "logprob": -0.5, "bytes": [117, 48]}]}
    else:
        assert first == ("t0", -1.5, {"u0": -0.5, "t0": -1.5}, 0)


def test_a_request_without_logprobs_gets_none_back() -> None:
    params = RequestParams.parse("completion", {"prompt": "hi", "max_tokens": 1})
    assembly = StreamAssembly(params)
    chunks = assembly.accept(_chunk("completion", 0, first=True, last=True)) + assembly.closing_chunks()
    assert [c["choices"][0]["logprobs"] for c in chunks] == [None]
    assert "logprobs" not in params.continuation_body([1, 2], 1, 1)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_streamed_request_sends_each_tokens_logprobs_once_and_keeps_none(kind: str) -> None:
    """Only a non-streamed body needs every token's logprobs at the end; a stream's are sent and dropped."""
    streamed = RequestParams.parse(kind, {**_body(kind), "stream": True})
    assembly = StreamAssembly(streamed)
    sent = [c for i in range(HELD + 1) for c in assembly.accept(_chunk(kind, i, first=i == 0))]
    _path, body = assembly.continuation(priority=1)
    done = body["output_offset"]
    for i in range(done, len(TOKENS)):
        sent += assembly.accept(_chunk("completion", i, first=i == done, last=i == len(TOKENS) - 1))
    sent += assembly.closing_chunks()

    whole = StreamAssembly(RequestParams.parse(kind, _body(kind)))
    for i in range(len(TOKENS)):
        whole.accept(_chunk(kind, i, first=i == 0, last=i == len(TOKENS) - 1))
    assert _client_logprobs(kind, sent) == _client_logprobs(kind, [whole.full_response()])
    assert assembly.logprobs == [] and len(whole.logprobs) == len(TOKENS)
