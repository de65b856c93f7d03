"""Token log-probabilities as the OpenAI API shows them, both ways.

Where it sits: the engine hands back :class:`inference.output.TokenLogprob` (token ids and floats);
:mod:`inference.protocol` turns them into the ``logprobs`` object of a choice through :class:`TokenStrings`
and :func:`chat_logprobs` or :func:`completion_logprobs`. The gateway, which stitches a stream resumed on
another replica (a chat resumed as a completion of token ids), reads either shape back into
:class:`LogprobEntry` values with :func:`read_chat_logprobs` and :func:`read_completion_logprobs`, which
raise :class:`MalformedLogprobs` (a ``ValueError``) for anything else a replica sends.

A token that is not whole UTF-8 on its own (a byte-level piece of a character) is spelled
``bytes:\\xe2\\x80`` as OpenAI spells it; ``bytes`` in a chat entry are always the token's own bytes.
The values are the model's raw distribution, before penalties, temperature and filters (vLLM V1's default).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inference.output import TokenLogprob

# JSON has no -Infinity; a token the model rules out entirely is shown with this floor (as vLLM does).
MIN_LOGPROB = -9999.0
BYTES_PREFIX = "bytes:"
_ESCAPED_BYTE = re.compile(r"\\x([0-9a-fA-F]{2})")


@dataclass(slots=True, frozen=True)
class LogprobEntry:
    """One output token: its text, log-probability and most likely alternatives (most likely first)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def token_string(raw: bytes) -> str:
    """A token's text, or ``bytes:\\xNN...`` when its bytes are not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw)


def num_chars(token: str) -> int:
    """How many characters of text a token string stands for."""
    if token.startswith(BYTES_PREFIX):
        return len(bytes(string_bytes(token)).decode("utf-8", errors="replace"))
    return len(token)


def string_bytes(token: str) -> list[int]:
    """The bytes a token string stands for (the inverse of :func:`token_string`)."""
    if token.startswith(BYTES_PREFIX):
        return [int(h, 16) for h in _ESCAPED_BYTE.findall(token[len(BYTES_PREFIX):])]
    return list(token.encode("utf-8"))


class TokenStrings:
    """Token id -> its string, cached (a replica sees the same few thousand tokens again and again)."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = token_string(self._token_bytes(token_id))
        return text

    def entries(self, logprobs: Sequence[TokenLogprob]) -> list[LogprobEntry]:
        return [LogprobEntry(self(lp.token_id), _finite(lp.logprob),
                             tuple((self(t), _finite(v)) for t, v in lp.top)) for lp in logprobs]


def _finite(value: float) -> float:
    return max(value, MIN_LOGPROB)


# ---- the two OpenAI shapes -------------------------------------------------------------------
def chat_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    """``choices[].logprobs`` of /v1/chat/completions: one object per token in ``content``."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": string_bytes(e.token),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": string_bytes(t)}
                                          for t, v in e.top]} for e in entries]}


def completion_logprobs(entries: Sequence[LogprobEntry], text_offset: int = 0) -> dict[str, Any]:
    """``choices[].logprobs`` of /v1/completions. ``top_logprobs`` maps the most likely tokens to their
    log-probabilities and always holds the chosen token too (so up to ``logprobs + 1`` entries, as OpenAI
    documents); ``text_offset`` counts the characters of the text before each token, from ``text_offset``
    on (a piece of a character counts as the U+FFFD it shows as alone)."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += num_chars(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{**dict(e.top), e.token: e.logprob} for e in entries], "text_offset": offsets}


class MalformedLogprobs(ValueError):
    """A ``logprobs`` object read back that is not in its endpoint's shape (a broken or foreign replica)."""


def read_chat_logprobs(logprobs: Any) -> list[LogprobEntry]:
    """Entries from a chat choice's ``logprobs`` (none when it has none); :class:`MalformedLogprobs` when
    it is not the shape :func:`chat_logprobs` writes."""
    content = _list(_object(logprobs, "logprobs").get("content"), "logprobs.content")
    return [_chat_entry(_object(c, "logprobs.content[]")) for c in content]


def _chat_entry(entry: Mapping[str, Any]) -> LogprobEntry:
    top = [_object(t, "top_logprobs[]") for t in _list(entry.get("top_logprobs"), "top_logprobs")]
    return LogprobEntry(_token(entry.get("token")), _logprob(entry.get("logprob")),
                        tuple((_token(t.get("token")), _logprob(t.get("logprob"))) for t in top))


def read_completion_logprobs(logprobs: Any, num_top: int) -> list[LogprobEntry]:
    """Entries from a completion choice's ``logprobs``, keeping the ``num_top`` most likely alternatives
    (the map also holds the chosen token when it is not among them); :class:`MalformedLogprobs` when it
    is not the shape :func:`completion_logprobs` writes."""
    logprobs = _object(logprobs, "logprobs")
    tokens = [_token(t) for t in _list(logprobs.get("tokens"), "logprobs.tokens")]
    values = [_logprob(v) for v in _list(logprobs.get("token_logprobs"), "logprobs.token_logprobs")]
    tops = _list(logprobs.get("top_logprobs"), "logprobs.top_logprobs") or [None] * len(tokens)
    if not len(tokens) == len(values) == len(tops):
        raise MalformedLogprobs(f"logprobs: {len(tokens)} tokens, {len(values)} token_logprobs and "
                                f"{len(tops)} top_logprobs")
    return [LogprobEntry(token, value, _most_likely(_object(top, "logprobs.top_logprobs[]"), num_top))
            for token, value, top in zip(tokens, values, tops, strict=True)]


def _most_likely(top: Mapping[str, Any], num_top: int) -> tuple[tuple[str, float], ...]:
    pairs = [(_token(t), _logprob(v)) for t, v in top.items()]
    return tuple(sorted(pairs, key=lambda item: -item[1])[:num_top])


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise MalformedLogprobs(f"{where}: an object expected, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise MalformedLogprobs(f"{where}: a list expected, got {type(value).__name__}")
    return value


def _token(value: Any) -> str:
    if not isinstance(value, str):
        raise MalformedLogprobs(f"a token must be a string, got {value!r:.40}")
    return value


def _logprob(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedLogprobs(f"a logprob must be a number, got {value!r:.40}")
    return float(value)
