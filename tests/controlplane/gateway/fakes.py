"""In-process fake replicas behind an ``httpx.MockTransport``: the gateway's logic without processes.

A fake replica speaks the replica API's streaming dialect (``return_token_ids``, ``prompt_token_ids`` in
the first chunk, ``output_offset``, a usage chunk with ``timings``, ``[DONE]``) and generates a
deterministic function of the *original* prompt and the absolute output position, so a continuation
elsewhere produces what the undisturbed stream would have. Like a real detokenizer it holds back the text
of some tokens (every token divisible by 5 is released together with the next one), which is what makes
resuming text exact non-trivial. Asked for logprobs, it sends each token's (a function of the token), in
the endpoint's shape. Each replica can be told to refuse, break, stall, error or send malformed logprobs
mid-stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from controlplane.replicas import ReplicaEndpoint, ReplicaState
from inference.logprobs import LogprobEntry, chat_logprobs, completion_logprobs

MODEL = "fake-model"


def token_at(prompt_ids: list[int], position: int) -> int:
    return (sum(prompt_ids) * 7 + position * 3) % 90 + 10


def piece(token: int) -> str:
    return f"<{token}>"


def is_held(token: int) -> bool:
    return token % 5 == 0


def logprob_of(token: int, num_top: int) -> LogprobEntry:
    """A token's logprobs: as in greedy decoding, the chosen token is the most likely alternative."""
    value = -0.25 * (token % 8) - 0.125
    top = [(piece(token), value), *((f"<alt{k}>", value - 1.0 - k) for k in range(num_top - 1))]
    return LogprobEntry(piece(token), value, tuple(top[:num_top]))


def num_logprobs(kind: str, body: dict[str, Any]) -> int | None:
    """Alternatives per token the request asks for; None: no logprobs."""
    if kind == "chat":
        return int(body.get("top_logprobs") or 0) if body.get("logprobs") is True else None
    value = body.get("logprobs")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# Malformed in either shape: a chat entry without its token, a completion token that is not a string.
MALFORMED_LOGPROBS = {"content": [{"logprob": -1.0}], "tokens": [None], "token_logprobs": [-1.0]}


def encode(kind: str, body: dict[str, Any]) -> list[int]:
    if kind == "chat":
        text = "".join(f"|{m['role']}:{m['content']}" for m in body["messages"]) + "|assistant:"
        return [1, *text.encode()]
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else [1, *prompt.encode()]


@dataclass
class Behaviour:
    """What one fake replica does with the next requests."""

    refuse_status: int | None = None  # answer every request with this status
    refuse_colour: str | None = None  # answer 500 to the requests of this colour (a coloured error_rate)
    break_after: int | None = None  # tokens, then the connection resets (once)
    stall_after: int | None = None  # tokens, then nothing (once)
    hang_after: int | None = None  # every stream from now on: tokens, then nothing (a hung replica)
    error_frame_after: int | None = None  # tokens, then an error frame (once)
    bad_logprobs_after: int | None = None  # tokens, then a chunk with ``bad_logprobs`` as logprobs (once)
    bad_logprobs: Any = field(default_factory=lambda: dict(MALFORMED_LOGPROBS))
    ready: bool = True
    unreachable: bool = False  # connections are refused (a killed process on a port still listed)
    unanswered: bool = False  # connections are accepted and nothing is answered (a stopped process)


@dataclass
class FakeReplica:
    replica_id: str
    port: int
    behaviour: Behaviour = field(default_factory=Behaviour)
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    state: ReplicaState = ReplicaState.READY
    labels: tuple[tuple[str, str], ...] = ()
    headers: list[dict[str, str]] = field(default_factory=list)  # of each generation request

    @property
    def endpoint(self) -> ReplicaEndpoint:
        return ReplicaEndpoint(self.replica_id, "az-a", "127.0.0.1", self.port, self.state, MODEL,
                               labels=self.labels)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.behaviour.unanswered:
            await asyncio.sleep(3600)
        if path == "/ready":  # a forward pass: a hung replica never finishes one
            if self.behaviour.hang_after is not None:
                await asyncio.sleep(3600)
            return httpx.Response(200 if self.behaviour.ready else 503, json={"status": "?"})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        body = json.loads(request.content)
        self.requests.append((path, body))
        self.headers.append(dict(request.headers))
        coloured = self.behaviour.refuse_colour is not None \
            and request.headers.get("x-llmsre-colour") == self.behaviour.refuse_colour
        if self.behaviour.refuse_status is not None or coloured:
            status = self.behaviour.refuse_status or 500
            return httpx.Response(status, headers={"Retry-After": "1"}, json={"error": {
                "message": f"refused by {self.replica_id}", "type": "server_error", "param": None,
                "code": None}})
        kind = "chat" if path.endswith("chat/completions") else "completion"
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=FakeStream(self._events(kind, body)))

    def _take(self, name: str) -> int | None:
        value: int | None = getattr(self.behaviour, name)
        setattr(self.behaviour, name, None)
        return value

    async def _events(self, kind: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        prompt = encode(kind, body)
        offset = body.get("output_offset", 0)
        original = prompt[:len(prompt) - offset]
        max_tokens = body.get("max_tokens", 16)
        cut = {name: self._take(name)
               for name in ("break_after", "stall_after", "error_frame_after", "bad_logprobs_after")}
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{self.replica_id}"
        num_top = num_logprobs(kind, body)
        held, text_offset = "", 0
        for i in range(max_tokens):
            if i == cut["break_after"]:
                raise httpx.ReadError("connection reset by peer")
            if i == cut["stall_after"] or (self.behaviour.hang_after is not None
                                           and i >= self.behaviour.hang_after):
                await asyncio.sleep(3600)
            if i == cut["error_frame_after"]:
                yield _data({"error": {"message": "device failure", "type": "server_error"}})
                return
            token = token_at(original, offset + i)
            last = i == max_tokens - 1
            held += piece(token)
            text, held = ("", held) if is_held(token) and not last else (held, "")
            chunk = self._chunk(kind, rid, text, token, prompt if i == 0 else None,
                                "length" if last else None)
            if num_top is not None:
                entry = [logprob_of(token, num_top)]
                shown = chat_logprobs(entry) if kind == "chat" else completion_logprobs(entry, text_offset)
                text_offset += len(piece(token))
                bad = i == cut["bad_logprobs_after"]
                chunk["choices"][0]["logprobs"] = self.behaviour.bad_logprobs if bad else shown
            yield _data(chunk)
            await asyncio.sleep(0)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                 "total_tokens": len(prompt) + max_tokens, "prompt_tokens_details": {"cached_tokens": 0}}
        timings = {"replica": self.replica_id, "queue": 0.001, "prefill": 0.002, "decode": 0.003,
                   "detokenize": 0.0, "serialize": 0.0}
        yield _data({"id": rid, "object": "x", "created": 1, "model": MODEL, "choices": [], "usage": usage,
                     "timings": timings})
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _chunk(kind: str, rid: str, text: str, token: int, prompt: list[int] | None,
               reason: str | None) -> dict[str, Any]:
        if kind == "chat":
            delta = {"role": "assistant", "content": text} if prompt is not None else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        choice["token_ids"] = [token]
        chunk: dict[str, Any] = {"id": rid, "object": "chunk", "created": 1, "model": MODEL,
                                 "choices": [choice]}
        if prompt is not None:
            chunk["prompt_token_ids"] = prompt
        return chunk


def _data(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class FakeStream(httpx.AsyncByteStream):
    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for event in self.events:
            yield event

    async def aclose(self) -> None:
        await self.events.aclose()  # type: ignore[attr-defined]


def expected_logprobs(kind: str, body: dict[str, Any]) -> list[LogprobEntry]:
    """The logprobs of the undisturbed output of any fake replica for ``body``."""
    tokens, _text = expected_completion(kind, body)
    return [logprob_of(t, num_logprobs(kind, body) or 0) for t in tokens]


def expected_completion(kind: str, body: dict[str, Any]) -> tuple[list[int], str]:
    """The undisturbed output of any fake replica for ``body``."""
    prompt = encode(kind, body)
    tokens = [token_at(prompt, i) for i in range(body.get("max_tokens", 16))]
    return tokens, "".join(piece(t) for t in tokens)


class FakeFleet:
    """Replicas r0, r1, r2 on ports 9001.. behind one MockTransport."""

    def __init__(self, n: int = 3) -> None:
        self.replicas = {f"r{i}": FakeReplica(f"r{i}", 9001 + i) for i in range(n)}
        self.transport = httpx.MockTransport(self._route)

    def endpoints(self) -> list[ReplicaEndpoint]:
        return [r.endpoint for r in self.replicas.values()]

    def __getitem__(self, replica_id: str) -> FakeReplica:
        return self.replicas[replica_id]

    async def _route(self, request: httpx.Request) -> httpx.Response:
        port = request.url.port
        replica = next((r for r in self.replicas.values() if r.port == port), None)
        if replica is None or replica.behaviour.unreachable:
            raise httpx.ConnectError("connection refused", request=request)
        return await replica.handle(request)


def sse_payloads(text: str) -> list[Any]:
    """The parsed ``data:`` payloads of an SSE body; ``[DONE]`` as the string."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_text(payloads: list[Any]) -> str:
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in payloads if isinstance(c, dict) and c.get("choices"))


def stream_token_ids(payloads: list[Any]) -> list[int]:
    return [t for c in payloads if isinstance(c, dict) and c.get("choices")
            for t in c["choices"][0].get("token_ids", [])]

