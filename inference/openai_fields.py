"""Which request fields of the OpenAI API this server honours, which it refuses, and its extensions.

Where it sits: :mod:`inference.protocol` checks every request body against these sets before parsing it.
A field the server does not act on is refused with a 400 naming it, unless its value is one that asks for
nothing (``echo: false``, ``tools: []``, ``response_format: {"type": "text"}``): a client must never get an
answer that silently ignored what it asked for. The README's parameter table lists the same fields.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# The request fields OpenAI documents for /v1/completions and /v1/chat/completions.
OPENAI_FIELDS = frozenset({
    "model", "prompt", "messages", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "top_logprobs", "max_tokens", "max_completion_tokens", "n", "presence_penalty", "seed", "stop", "stream",
    "stream_options", "suffix", "temperature", "top_p", "user", "tools", "tool_choice", "functions",
    "function_call", "parallel_tool_calls", "response_format", "metadata", "store", "service_tier",
    "modalities", "audio", "prediction", "reasoning_effort", "web_search_options", "verbosity",
    "prompt_cache_key", "safety_identifier",
})
EXTENSION_FIELDS = frozenset({"top_k", "ignore_eos", "min_tokens", "priority", "return_token_ids",
                              "output_offset", "repetition_penalty"})
KNOWN_FIELDS = OPENAI_FIELDS | EXTENSION_FIELDS

# Refused fields: the values accepted because they ask for nothing, and why any other is refused.
REFUSED: Mapping[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((1,), "one completion is generated per request"),
    "echo": ((False,), "the prompt is not echoed back"),
    "suffix": (("",), "there is no insertion mode"),
    "logit_bias": (({},), "logit biases are not applied"),
    "tools": (([],), "there is no tool calling"),
    "tool_choice": (("none",), "there is no tool calling"),
    "parallel_tool_calls": ((), "there is no tool calling"),
    "functions": (([],), "there is no function calling"),
    "function_call": (("none",), "there is no function calling"),
    "response_format": (({"type": "text"},), "there is no structured (JSON) output"),
    "store": ((False,), "completions are not stored"),
    "service_tier": (("auto", "default"), "there is one service tier"),
    "modalities": ((["text"],), "the output is text only"),
    "audio": ((), "the output is text only"),
    "prediction": ((), "there are no predicted outputs"),
    "reasoning_effort": ((), "the served model has no reasoning-effort control"),
    "verbosity": ((), "the served model has no verbosity control"),
    "web_search_options": ((), "there is no web search"),
}
# Identifiers that, as in OpenAI's API, never change the answer: accepted and not stored.
IDENTIFIERS = frozenset({"user", "safety_identifier", "prompt_cache_key", "metadata"})


def refusal(name: str, value: Any) -> str | None:
    """Why ``value`` of refused field ``name`` is refused, or None when it asks for nothing."""
    accepted, reason = REFUSED[name]
    if value is None or any(type(value) is type(a) and value == a for a in accepted):
        return None
    allowed = ", ".join(["null", *(json.dumps(a) for a in accepted)])
    return f"not supported: {reason} (accepted: {allowed})"

