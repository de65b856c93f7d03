"""OpenAI request bodies to engine inputs, and engine outputs to OpenAI response bodies.

Requests are validated here with one error type, :class:`InvalidParameterError`, whose ``param`` names
the offending field, so the server can answer 400 in the OpenAI error shape; which fields are honoured,
refused or extensions is :mod:`inference.openai_fields`'s to say. Responses are plain dicts (cheap to
serialize on the hot path); the ``timings`` extension field carries the stage timings, and ``logprobs``
(when asked for) the shape of :mod:`inference.logprobs`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inference.logprobs import TokenStrings, chat_logprobs, completion_logprobs, num_chars
from inference.openai_fields import KNOWN_FIELDS, REFUSED, refusal
from inference.output import RequestOutput, TokenLogprob
from inference.sampling_params import MAX_LOGPROBS, InvalidParameterError, SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16
# A client may pick a scheduling priority only within the gateway's classes (interactive 0, standard 1,
# batch 2); values outside are clamped, so that no request jumps ahead of the readiness probes.
MIN_PRIORITY, MAX_PRIORITY = 0, 2


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str | None
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    max_tokens_given: bool
    return_token_ids: bool = False  # extension: token ids in every chunk, prompt ids in the first


def parse_completion(body: Any) -> ParsedRequest:
    body = _object(body)
    prompt = _prompt(body.get("prompt"))
    return _parse(body, "completion", prompt, default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS)


def parse_chat(body: Any, render: Callable[[list[dict[str, Any]]], str]) -> ParsedRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidParameterError("messages", "must be a non-empty list of {role, content} objects")
    normalized = [_message(i, m) for i, m in enumerate(messages)]
    try:
        prompt = render(normalized)
    except ValueError as exc:
        raise InvalidParameterError("messages", f"chat template failed: {exc}") from exc
    return _parse(body, "chat", prompt, default_max_tokens=None)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidParameterError("body", "must be a JSON object")
    # Anything unknown is a 400 naming it, as OpenAI answers: a misspelt parameter must not be dropped.
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise InvalidParameterError(unknown[0][:64], "unrecognized request argument")
    for name in REFUSED:
        reason = refusal(name, body.get(name))
        if reason is not None:
            raise InvalidParameterError(name, reason)
    return body


def _parse(body: dict[str, Any], kind: str, prompt: str | list[int], *,
           default_max_tokens: int | None) -> ParsedRequest:
    n = body.get("n")
    if n is not None and n != 1:  # null means the default, 1, as in the OpenAI API
        raise InvalidParameterError("n", f"only n=1 is supported, got {n!r}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidParameterError("model", "must be a string")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stream = _bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidParameterError("stream_options", "must be an object")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidParameterError("priority", f"must be an integer, got {priority!r}")
    priority = min(max(priority, MIN_PRIORITY), MAX_PRIORITY)
    params = _sampling(body, kind, max_tokens if max_tokens is not None else default_max_tokens)
    return ParsedRequest(kind, model, prompt, params, stream, _bool(options, "include_usage", False),
                         priority, max_tokens is not None or default_max_tokens is not None,
                         _bool(body, "return_token_ids", False))


def _sampling(body: dict[str, Any], kind: str, max_tokens: Any) -> SamplingParams:
    logprobs = _chat_logprobs(body) if kind == "chat" else _completion_logprobs(body)
    top_k = body.get("top_k")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list):
        stop = tuple(stop)
    else:
        raise InvalidParameterError("stop", "must be a string or a list of strings")
    values = {
        "max_tokens": 1 << 30 if max_tokens is None else max_tokens,  # clamped to the context later
        "temperature": _number(body, "temperature", 1.0),
        "top_p": _number(body, "top_p", 1.0),
        "top_k": 0 if top_k is None or top_k == -1 else top_k,  # vLLM spells "disabled" -1 or null
        "seed": body.get("seed"),
        "stop": stop,
        "ignore_eos": _bool(body, "ignore_eos", False),
        "min_tokens": body.get("min_tokens", 0),
        "output_offset": body.get("output_offset", 0),
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),
        "logprobs": logprobs,
    }
    for name in ("max_tokens", "top_k", "min_tokens", "seed", "output_offset", "logprobs"):
        value = values[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    return SamplingParams(**values)


def _completion_logprobs(body: dict[str, Any]) -> Any:
    """/v1/completions: ``logprobs`` is how many alternatives per token (0 for the chosen token's only)."""
    if body.get("top_logprobs") is not None:
        raise InvalidParameterError("top_logprobs", "is a /v1/chat/completions field; on /v1/completions "
                                                    "logprobs (an integer) says how many alternatives")
    return body.get("logprobs")


def _chat_logprobs(body: dict[str, Any]) -> Any:
    """/v1/chat/completions: ``logprobs`` (true or false) and ``top_logprobs`` alternatives per token."""
    wanted = _bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and not wanted:
        raise InvalidParameterError("top_logprobs", "needs logprobs: true")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise InvalidParameterError("top_logprobs", f"must be an integer, got {top!r}")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidParameterError("top_logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {top!r}")
    return (top or 0) if wanted else None


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, f"must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError as exc:  # an integer with hundreds of digits
        raise InvalidParameterError(name, "must be a number, got an integer too large for one") from exc


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParameterError(name, f"must be true or false, got {value!r}")
    return value


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return prompt
    raise InvalidParameterError("prompt", "must be a non-empty string or list of token ids (one prompt)")


def _message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidParameterError(f"messages[{index}]", "must be an object with a string 'role'")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidParameterError(f"messages[{index}].content", "only text parts are supported")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidParameterError(f"messages[{index}].content", "must be a string or a list of text parts")
    return {"role": message["role"], "content": content}


# ---- responses -------------------------------------------------------------------------------
@dataclass(slots=True)
class ResponseContext:
    kind: str
    request_id: str
    model: str
    created: int

    @classmethod
    def new(cls, kind: str, model: str) -> ResponseContext:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, f"{prefix}-{uuid.uuid4().hex}", model, int(time.time()))

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), len(out.output_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens}}


@dataclass(slots=True)
class LogprobsView:
    """One response's ``logprobs`` objects, chunk after chunk, in the endpoint's shape (completions'
    ``text_offset`` runs on across chunks)."""

    ctx: ResponseContext
    strings: TokenStrings
    text_offset: int = 0

    def __call__(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """The object for these tokens; None when the request did not ask for logprobs."""
        if logprobs is None:
            return None
        entries = self.strings.entries(logprobs)
        if self.ctx.kind == "chat":
            return chat_logprobs(entries)
        shown = completion_logprobs(entries, self.text_offset)
        self.text_offset += sum(num_chars(e.token) for e in entries)
        return shown


def stream_chunk(ctx: ResponseContext, delta: str, finish_reason: str | None, *,
                 first: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if ctx.kind == "chat":
        d: dict[str, Any] = {"role": "assistant", "content": delta} if first else {"content": delta}
        choice: dict[str, Any] = {"index": 0, "delta": d, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": ctx.request_id, "object": ctx.chunk_object, "created": ctx.created, "model": ctx.model,
            "choices": [choice]}


def usage_chunk(ctx: ResponseContext, out: RequestOutput) -> dict[str, Any]:
    return {"id": ctx.request_id, "object": ctx.chunk_object, "created": ctx.created, "model": ctx.model,
            "choices": [], "usage": usage(out)}


def full_response(ctx: ResponseContext, out: RequestOutput, *,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if ctx.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": out.text},
                                  "logprobs": logprobs, "finish_reason": out.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}
        obj = "text_completion"
    return {"id": ctx.request_id, "object": obj, "created": ctx.created, "model": ctx.model,
            "choices": [choice], "usage": usage(out)}


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None
               ) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
