"""The generic decoder of the client's records: :func:`decode` builds a record of :mod:`controlplane.views`
(any frozen dataclass) from parsed JSON, checking every field's type and ignoring keys it does not know (so
an older console keeps working against a newer control plane); :func:`as_json` turns records back into
plain JSON values (``--json`` output of the CLI).

Where it sits: the client decodes every answer here and turns :class:`UnexpectedAnswer` into its ApiError;
the records' modules import only the field helpers (``Number``, ``Scalar``, ``DOCUMENT``).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from controlplane.errors import ControlPlaneError

T = TypeVar("T")
Number = int | float  # a JSON number whose int-ness the readers keep (counts print without decimals)
Scalar = str | int | float | bool | None
DOCUMENT = {"document": True}  # field metadata: the whole answer, as sent


class UnexpectedAnswer(ControlPlaneError):
    """An answer that does not have the shape the client expects (another version of the control plane)."""


def decode(cls: type[T], raw: object, where: str = "") -> T:
    """``raw`` (parsed JSON) as a ``cls`` record; UnexpectedAnswer naming the first field that is off."""
    return typing.cast(T, _decode(cls, raw, where or cls.__name__))


def decode_list(cls: type[T], raw: object, where: str = "") -> list[T]:
    if not isinstance(raw, list):
        raise UnexpectedAnswer(f"{where or cls.__name__}: expected a list, got {type(raw).__name__}")
    return [decode(cls, item, f"{where or cls.__name__}[{i}]") for i, item in enumerate(raw)]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(tp: Any, raw: Any, where: str) -> Any:
    if tp is Any:
        return raw
    if dataclasses.is_dataclass(tp):
        return _record(typing.cast(type, tp), raw, where)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return _union(args, raw, where)
    if origin is tuple:
        return _tuple(args, raw, where)
    if origin in (Mapping, dict):
        if not isinstance(raw, dict):
            raise UnexpectedAnswer(f"{where}: expected an object, got {type(raw).__name__}")
        return {str(k): _decode(args[1], v, f"{where}.{k}") for k, v in raw.items()}
    return _scalar(tp, raw, where)


def _record(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise UnexpectedAnswer(f"{where}: expected an object, got {type(raw).__name__}")
    hints, values = _hints(cls), {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("document"):
            values[f.name] = dict(raw)
        elif f.name in raw:
            values[f.name] = _decode(hints[f.name], raw[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UnexpectedAnswer(f"{where}.{f.name}: missing")
    return cls(**values)


def _union(args: tuple[Any, ...], raw: Any, where: str) -> Any:
    if raw is None and type(None) in args:
        return None
    problems = []
    for option in (a for a in args if a is not type(None)):
        try:
            return _decode(option, raw, where)
        except UnexpectedAnswer as exc:
            problems.append(str(exc))
    raise UnexpectedAnswer(problems[0] if len(problems) == 1 else f"{where}: unexpected value {raw!r}")


def _tuple(args: tuple[Any, ...], raw: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(raw, list | tuple):
        raise UnexpectedAnswer(f"{where}: expected a list, got {type(raw).__name__}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_decode(args[0], item, f"{where}[{i}]") for i, item in enumerate(raw))
    if len(raw) != len(args):
        raise UnexpectedAnswer(f"{where}: expected {len(args)} items, got {len(raw)}")
    return tuple(_decode(a, item, f"{where}[{i}]") for i, (a, item) in enumerate(zip(args, raw)))


def _scalar(tp: Any, raw: Any, where: str) -> Any:
    if tp is float and isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    if tp is int and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if tp in (str, bool) and type(raw) is tp:
        return raw
    if tp is type(None) and raw is None:
        return None
    raise UnexpectedAnswer(f"{where}: expected {getattr(tp, '__name__', tp)}, got {raw!r}")


def as_json(value: Any) -> Any:
    """Records (and lists or mappings of them) as plain JSON values, the ``document`` fields left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get("document")}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): as_json(v) for k, v in value.items()}
    return value
