"""Strict JSON for request bodies: what ``json.loads`` accepts beyond RFC 8259, refused with a reason.

Refused: NaN and Infinity (and numbers too large for a float), nesting beyond the interpreter's recursion
limit, integers longer than Python converts (4,300 digits), invalid UTF-8, and strings holding half of a
surrogate pair (JSON may escape one; the tokenizer and the response encoder cannot handle it).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any


class BadJson(ValueError):
    """The body is not strict JSON; the message says why, for a 400."""


def parse_strict(raw: bytes) -> Any:
    """``raw`` parsed as strict JSON, or :class:`BadJson` naming what is wrong with it."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise BadJson("request body is nested too deeply") from exc
    except UnicodeDecodeError as exc:
        raise BadJson(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise BadJson(f"request body is not valid JSON: {exc}") from exc
    except _NotANumber as exc:
        raise BadJson(f"request body is not valid JSON: {exc}") from exc
    except ValueError as exc:  # int() of a number too long to convert
        limit = sys.get_int_max_str_digits()
        raise BadJson(f"request body holds an integer longer than {limit} digits") from exc
    if not _is_unicode(body):
        raise BadJson("request body holds a string with a lone surrogate escape (\\ud800-\\udfff), "
                      "which is not Unicode text")
    return body


def _is_unicode(body: Any) -> bool:
    """Whether every string in ``body`` (keys included) is encodable text: JSON may escape half of a
    surrogate pair, which the tokenizer and the response encoder cannot handle. Iterative: the body may be
    nested as deep as the parser allowed."""
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not _encodable(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _NotANumber(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotANumber(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotANumber(f"{text[:40]} is out of range for a number")
    return value
