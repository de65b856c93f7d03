"""OpenAI request bodies to engine inputs, and engine outputs to OpenAI response bodies.

Requests are validated here with one error type, :class:`InvalidParameterError`, whose ``param`` names
the offending field, so the server can answer 400 in the OpenAI error shape. Responses are plain dicts
(cheap to serialize on the hot path); the ``timings`` extension field carries the stage timings.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inference.output import RequestOutput
from inference.sampling_params import InvalidParameterError, SamplingParams

UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias")
COMPLETION_DEFAULT_MAX_TOKENS = 16
# The request fields OpenAI documents (accepted; those this server does not act on are ignored, or refused
# above when they would change the answer) and this server's extensions. Anything else is a 400 naming it,
# as OpenAI answers: a misspelt parameter must not be silently dropped.
OPENAI_FIELDS = frozenset({
    "model", "prompt", "messages", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "top_logprobs", "max_tokens", "max_completion_tokens", "n", "presence_penalty", "seed", "stop", "stream",
    "stream_options", "suffix", "temperature", "top_p", "user", "tools", "tool_choice", "functions",
    "function_call", "parallel_tool_calls", "response_format", "metadata", "store", "service_tier",
    "modalities", "audio", "prediction", "reasoning_effort", "web_search_options", "verbosity",
    "prompt_cache_key", "safety_identifier",
})
EXTENSION_FIELDS = frozenset({"top_k", "ignore_eos", "min_tokens", "priority", "return_token_ids",
                              "output_offset"})
KNOWN_FIELDS = OPENAI_FIELDS | EXTENSION_FIELDS
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
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise InvalidParameterError(unknown[0][:64], "unrecognized request argument")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise InvalidParameterError(name, "is not supported by this server")
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
    params = _sampling(body, max_tokens if max_tokens is not None else default_max_tokens)
    return ParsedRequest(kind, model, prompt, params, stream, _bool(options, "include_usage", False),
                         priority, max_tokens is not None or default_max_tokens is not None,
                         _bool(body, "return_token_ids", False))


def _sampling(body: dict[str, Any], max_tokens: Any) -> SamplingParams:
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
    }
    for name in ("max_tokens", "top_k", "min_tokens", "seed", "output_offset"):
        value = values[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    return SamplingParams(**values)


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


def stream_chunk(ctx: ResponseContext, delta: str, finish_reason: str | None, *,
                 first: bool = False) -> dict[str, Any]:
    if ctx.kind == "chat":
        d: dict[str, Any] = {"role": "assistant", "content": delta} if first else {"content": delta}
        choice: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"id": ctx.request_id, "object": ctx.chunk_object, "created": ctx.created, "model": ctx.model,
            "choices": [choice]}


def usage_chunk(ctx: ResponseContext, out: RequestOutput) -> dict[str, Any]:
    return {"id": ctx.request_id, "object": ctx.chunk_object, "created": ctx.created, "model": ctx.model,
            "choices": [], "usage": usage(out)}


def full_response(ctx: ResponseContext, out: RequestOutput) -> dict[str, Any]:
    if ctx.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": out.text},
                                  "logprobs": None, "finish_reason": out.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        obj = "text_completion"
    return {"id": ctx.request_id, "object": obj, "created": ctx.created, "model": ctx.model,
            "choices": [choice], "usage": usage(out)}


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None
               ) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
