"""One request as the gateway sees it: its parameters (:class:`RequestParams`) and its stream assembled
from one or more upstream streams (:class:`StreamAssembly`), with the arithmetic of resuming a broken
stream on another replica without losing or repeating a token, or the log-probabilities of any."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.gateway.errors import bad_request
from controlplane.gateway.routing import prompt_block_hashes
from inference.logprobs import (
    LogprobEntry,
    MalformedLogprobs,
    chat_logprobs,
    completion_logprobs,
    num_chars,
    read_chat_logprobs,
    read_completion_logprobs,
)
from inference.protocol import COMPLETION_DEFAULT_MAX_TOKENS

logger = logging.getLogger(__name__)


PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
# Fields a continuation carries over from the original request (besides prompt, limits and offsets).
CARRIED_FIELDS = ("model", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "presence_penalty",
                  "frequency_penalty", "repetition_penalty")

CHARS_PER_TOKEN = 4  # prompt-size estimate for token rate limits (the gateway has no tokenizer)
AFFINITY_UNITS = 16 * 256  # prefix affinity hashes the first 256 blocks of a prompt at most
CHAT_MAX_TOKENS_ESTIMATE = 256  # a chat request without max_tokens, for the token rate limit


# ---- one request's parameters ----------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        return (stop,)
    return tuple(s for s in stop if isinstance(s, str)) if isinstance(stop, list) else ()


def _prompt_units(kind: str, body: dict[str, Any]) -> tuple[Sequence[int], bool]:
    """What prefix affinity hashes, and whether it is token ids: a token-id prompt as it is; else the
    prompt's UTF-8 bytes (the gateway has no tokenizer; equal leading text still means equal leading
    blocks on the replica, up to block boundaries). Text stays ``bytes`` (one byte per unit, not one
    Python int), and only the leading ``AFFINITY_UNITS`` count: affinity is about shared prefixes."""
    if kind == "chat":
        messages = body.get("messages")
        text = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        return text.encode(), False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return prompt, True
    return str(prompt).encode(), False


def _num_logprobs(kind: str, body: dict[str, Any]) -> int | None:
    """Alternatives per token the client asked for (None: no logprobs): completions' ``logprobs``, or
    chat's ``top_logprobs`` once ``logprobs`` is true."""
    if kind == "chat":
        top = body.get("top_logprobs")
        return (top if _is_int(top) else 0) if body.get("logprobs") is True else None
    value = body.get("logprobs")
    return value if _is_int(value) else None


def _is_deterministic(body: dict[str, Any]) -> bool:
    """Greedy or seeded: a continuation regenerates exactly what an undisturbed run would."""
    temperature = body.get("temperature")
    greedy = (isinstance(temperature, (int, float)) and temperature == 0) or body.get("top_k") == 1
    return greedy or _is_int(body.get("seed"))


@dataclass(slots=True, frozen=True)
class RequestParams:
    """What the gateway needs from a client's request body; the replica validates the rest."""

    kind: str  # completion | chat
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    wants_token_ids: bool
    max_tokens: int | None  # None: up to the context length
    min_tokens: int
    output_offset: int
    hold: int  # characters a replica holds back for stop strings (max stop length - 1)
    num_logprobs: int | None  # alternatives per token in logprobs; None: the client wants none
    is_deterministic: bool
    block_hashes: tuple[int, ...]
    num_tokens_estimate: int  # prompt + max_tokens, for the token rate limit

    @property
    def path(self) -> str:
        return PATHS[self.kind]

    @property
    def model(self) -> str:
        model = self.body.get("model")
        return model if isinstance(model, str) else ""

    @classmethod
    def parse(cls, kind: str, body: Any) -> RequestParams:
        if not isinstance(body, dict):
            raise bad_request("body", "must be a JSON object")
        stream, options = body.get("stream"), body.get("stream_options") or {}
        if stream is not None and not isinstance(stream, bool):
            raise bad_request("stream", f"must be true or false, got {stream!r}")
        if not isinstance(options, dict):
            raise bad_request("stream_options", "must be an object")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None and kind == "completion":
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
        units, are_tokens = _prompt_units(kind, body)
        prompt_estimate = len(units) if are_tokens else math.ceil(len(units) / CHARS_PER_TOKEN)
        units = units[:AFFINITY_UNITS]
        max_tokens = max_tokens if _is_int(max_tokens) else None  # a bad value: the replica answers 400
        return cls(kind=kind, body=body, stream=bool(stream),
                   include_usage=options.get("include_usage") is True,
                   wants_token_ids=body.get("return_token_ids") is True, max_tokens=max_tokens,
                   min_tokens=_int_or_zero(body.get("min_tokens")),
                   output_offset=_int_or_zero(body.get("output_offset")),
                   hold=max((len(s) for s in _stop_strings(body.get("stop"))), default=1) - 1,
                   num_logprobs=_num_logprobs(kind, body),
                   is_deterministic=_is_deterministic(body),
                   block_hashes=tuple(prompt_block_hashes(units)),
                   num_tokens_estimate=prompt_estimate + (max_tokens or CHAT_MAX_TOKENS_ESTIMATE))

    def upstream_body(self, priority: int) -> dict[str, Any]:
        """The client's request as a replica gets it: always a stream with token ids and usage."""
        options = {**(self.body.get("stream_options") or {}), "include_usage": True}
        return {**self.body, "stream": True, "stream_options": options, "return_token_ids": True,
                "priority": priority}

    def continuation_body(self, prompt_ids: list[int], num_done: int, priority: int) -> dict[str, Any]:
        """A /v1/completions request that goes on after ``num_done`` tokens (the last of ``prompt_ids``)."""
        body = {name: self.body[name] for name in CARRIED_FIELDS if name in self.body}
        body.update(prompt=prompt_ids, stream=True, stream_options={"include_usage": True},
                    return_token_ids=True, priority=priority, output_offset=self.output_offset + num_done)
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens - num_done
        if self.min_tokens:
            body["min_tokens"] = max(self.min_tokens - num_done, 0)
        if self.num_logprobs is not None:  # a chat goes on as a completion: its logprobs spelt so
            body["logprobs"] = self.num_logprobs
        return body


def _int_or_zero(value: Any) -> int:
    return value if _is_int(value) and value > 0 else 0


# ---- one request's stream, assembled from one or more upstream streams --------------------------
class BadEvent(ValueError):
    """An upstream chunk the assembly cannot read (malformed logprobs, or not one entry per token id): the
    replica's fault, which the gateway turns into an ``UpstreamError`` and resumes elsewhere."""


def _first_choice(event: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int]]:
    """An upstream chunk's choice (None in the usage chunk) and its token ids; :class:`BadEvent` when
    they are not what a replica sends."""
    choices = event.get("choices")
    if not choices:
        return None, []
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise BadEvent(f"choices: a list of objects expected, got {choices!r:.80}")
    ids = choices[0].get("token_ids") or []
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise BadEvent(f"token_ids: a list of integers expected, got {ids!r:.80}")
    return choices[0], list(ids)


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    return str((choice.get("delta") or {}).get("content") or "")


class StreamAssembly:
    """The client's view of one request, built from upstream chunks; plans continuations. No I/O.

    Positions are (tokens, characters) from the start of the completion. A *checkpoint* is a position
    where the replica had released the text of every token before it (a chunk with text), so a
    continuation starting there produces exactly the text that follows.
    """

    def __init__(self, params: RequestParams) -> None:
        self.params = params
        self.prompt_ids: list[int] | None = None
        self.token_ids: list[int] = []
        # One per token id, for the non-streamed body only: a stream sends each token's as it goes.
        self.logprobs: list[LogprobEntry] = []
        self.text: list[str] = []
        self.num_chars = 0
        self.checkpoints: list[tuple[int, int]] = [(0, 0)]
        self.meta: dict[str, Any] | None = None  # id, created, model of the first upstream stream
        self.finish_reason: str | None = None
        self.final_chunk: dict[str, Any] | None = None  # held until the usage chunk
        self.upstream_usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None
        self.num_resumes = 0
        self.num_mismatches = 0  # regenerated tokens that differed from those sent (nondeterminism)
        self._base = (0, 0)  # where the current upstream stream started
        self._produced = (0, 0)  # what the current upstream stream produced
        self._skip = (0, 0)  # regenerated tokens and characters still to drop
        self._sent_first = False
        self._logprob_chars = 0  # completions' text_offset of the next token

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """One upstream chunk in; the client chunks it releases out. :class:`BadEvent` when the chunk cannot
        be read, before it changed anything: the stream can go on elsewhere from the chunk before."""
        choice, ids = _first_choice(event)
        entries = [] if choice is None else self._entries(choice, len(ids))
        if self.meta is None:
            self.meta = {k: event.get(k) for k in ("id", "created", "model")}
        if event.get("timings"):
            self.timings = event["timings"]
        if choice is None:
            self.upstream_usage = event.get("usage") or self.upstream_usage
            return []
        if self.prompt_ids is None and isinstance(event.get("prompt_token_ids"), list):
            self.prompt_ids = list(event["prompt_token_ids"])
        text = _choice_text(choice)
        skipped = len(ids)
        ids, text = self._fresh(ids, text)
        entries = entries[skipped - len(ids):]
        self.token_ids.extend(ids)
        if not self.params.stream:
            self.logprobs.extend(entries)
        self.text.append(text)
        self.num_chars += len(text)
        reason = choice.get("finish_reason")
        if reason:
            self.finish_reason = reason
        return self._client_chunks(ids, text, reason, entries)

    def _entries(self, choice: dict[str, Any], num_tokens: int) -> list[LogprobEntry]:
        """The logprobs of a choice's ``num_tokens`` tokens, whichever endpoint's shape they came in."""
        shown = choice.get("logprobs")
        if self.params.num_logprobs is None or shown is None:
            return []
        try:
            if "delta" in choice:
                entries = read_chat_logprobs(shown)
            else:
                entries = read_completion_logprobs(shown, self.params.num_logprobs)
        except MalformedLogprobs as exc:
            raise BadEvent(str(exc)) from exc
        if len(entries) != num_tokens:  # stitching pairs each token with its own entry
            raise BadEvent(f"logprobs for {len(entries)} tokens in a chunk of {num_tokens} token ids")
        return entries

    def _fresh(self, ids: list[int], text: str) -> tuple[list[int], str]:
        """Records checkpoints; drops what a continuation regenerated up to the point already sent."""
        tokens, chars = self._produced[0] + len(ids), self._produced[1] + len(text)
        self._produced = (tokens, chars)
        if text:
            self.checkpoints.append((self._base[0] + tokens, self._base[1] + chars + self.params.hold))
        drop_ids, drop_chars = min(self._skip[0], len(ids)), min(self._skip[1], len(text))
        if drop_ids:
            at = self._base[0] + tokens - len(ids)
            if ids[:drop_ids] != self.token_ids[at:at + drop_ids]:
                self.num_mismatches += 1
        self._skip = (self._skip[0] - drop_ids, self._skip[1] - drop_chars)
        return ids[drop_ids:], text[drop_chars:]

    def _client_chunks(self, ids: list[int], text: str, reason: str | None,
                       entries: list[LogprobEntry]) -> list[dict[str, Any]]:
        first = not self._sent_first
        if not (text or reason or first or entries or (self.params.wants_token_ids and ids)):
            return []
        self._sent_first = True
        chunk = self._chunk([self._choice(ids, text, reason, first=first)])
        chunk["choices"][0]["logprobs"] = self._shown_logprobs(entries)
        if first and self.params.wants_token_ids:
            chunk["prompt_token_ids"] = self.prompt_ids
        if reason:
            self.final_chunk = chunk
            return []
        return [chunk]

    def _choice(self, ids: list[int], text: str, reason: str | None, *, first: bool) -> dict[str, Any]:
        if self.params.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.params.wants_token_ids:
            choice["token_ids"] = ids
        return choice

    def _shown_logprobs(self, entries: list[LogprobEntry]) -> dict[str, Any] | None:
        """The client's ``logprobs`` object for these tokens, in its endpoint's shape."""
        if self.params.num_logprobs is None:
            return None
        if self.params.kind == "chat":
            return chat_logprobs(entries)
        shown = completion_logprobs(entries, self._logprob_chars)
        self._logprob_chars += sum(num_chars(e.token) for e in entries)
        return shown

    def _chunk(self, choices: list[dict[str, Any]], *, obj: str | None = None) -> dict[str, Any]:
        meta = self.meta or {}
        default = "chat.completion.chunk" if self.params.kind == "chat" else "text_completion"
        return {"id": meta.get("id"), "object": obj or default, "created": meta.get("created"),
                "model": meta.get("model"), "choices": choices}

    def closing_chunks(self) -> list[dict[str, Any]]:
        """The finish chunk, with usage the way the client asked for it."""
        final = self.final_chunk
        if final is None:
            return []
        if not self.params.include_usage:
            final["usage"] = None
            if self.timings is not None:
                final["timings"] = self.timings
            return [final]
        tail = self._chunk([])
        tail["usage"] = self.usage()
        if self.timings is not None:
            tail["timings"] = self.timings
        return [final, tail]

    def finish_locally(self, reason: str) -> None:
        """Every token was delivered but the finish chunk was lost: finish without a replica."""
        self.finish_reason = reason
        self._client_chunks([], "", reason, [])

    def usage(self) -> dict[str, Any]:
        """The whole request's usage: the original prompt, every completion token of every stream."""
        upstream = self.upstream_usage or {}
        if self.num_resumes == 0 and upstream:
            return upstream
        prompt = int(upstream.get("prompt_tokens", 0)) if self.prompt_ids is None else len(self.prompt_ids)
        cached = (upstream.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {"prompt_tokens": prompt, "completion_tokens": len(self.token_ids),
                "total_tokens": prompt + len(self.token_ids),
                "prompt_tokens_details": {"cached_tokens": min(int(cached), prompt)}}

    def resume_point(self) -> tuple[int, int]:
        """Where a continuation starts: the last checkpoint within what was sent (deterministic
        sampling regenerates the rest identically); else right after the last token sent."""
        if not self.params.is_deterministic:
            return len(self.token_ids), self.num_chars
        sent = [c for c in self.checkpoints if c[0] <= len(self.token_ids) and c[1] <= self.num_chars]
        return max(sent, default=(0, 0))

    def continuation(self, priority: int) -> tuple[str, dict[str, Any]]:
        """The (path, body) of the request that goes on from the resume point."""
        num_done, chars = self.resume_point()
        self._base, self._produced = (num_done, chars), (0, 0)
        self._skip = (len(self.token_ids) - num_done, self.num_chars - chars)
        self.num_resumes += 1
        if num_done == 0 or self.prompt_ids is None:  # start over, dropping whatever was sent
            return self.params.path, self.params.upstream_body(priority)
        prompt = self.prompt_ids + self.token_ids[:num_done]
        return PATHS["completion"], self.params.continuation_body(prompt, num_done, priority)

    def is_exhausted(self) -> bool:
        """All max_tokens were delivered: nothing is left to generate."""
        return self.params.max_tokens is not None and len(self.token_ids) >= self.params.max_tokens

    def full_response(self) -> dict[str, Any]:
        """The non-streaming response body."""
        text = "".join(self.text)
        if self.params.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
            obj = "text_completion"
        self._logprob_chars = 0
        choice["logprobs"] = self._shown_logprobs(self.logprobs)
        body = self._chunk([choice], obj=obj)
        body["usage"] = self.usage()
        if self.params.wants_token_ids:
            choice["token_ids"] = self.token_ids
            body["prompt_token_ids"] = self.prompt_ids
        if self.timings is not None:
            body["timings"] = self.timings
        return body


