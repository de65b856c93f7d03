"""Gateway-link faults, in the manner of Toxiproxy's toxics: the link between the gateway and a replica
gets slower (``link-delay``) or fails (``link-abort``), while the replica itself stays healthy.

The toxics live in the gateway, which the chaos layer reaches through the small :class:`LinkControl`
protocol (the control plane's gateway supervisor satisfies it, applying each toxic on every gateway
process). Revert removes the toxic. A toxic carries the fault's duration and the gateways drop it when
that is over, so it ends on time even while the control plane is down; a revert that then finds nothing
to remove succeeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from chaos.faults.base import (
    Fault,
    FaultError,
    FaultKindInfo,
    FaultSpec,
    ParamInfo,
    RevertToken,
    Scalar,
    check_params,
)
from chaos.targets import Target

MAX_LATENCY_MS = 60_000
ABORT_MODES = ("refuse", "reset")


class LinkControl(Protocol):
    """Where link toxics are applied: ``add`` returns the toxic's id; ``remove`` is idempotent. The toxic
    ends by itself after ``duration_s`` where it lives (the gateways), even if no revert ever comes."""

    async def add(self, replica_id: str, toxic: Mapping[str, Scalar], *,
                  duration_s: float | None = None) -> str: ...

    async def remove(self, toxic_id: str) -> bool: ...


_COLOUR = ParamInfo("colour", "string", "only requests of this traffic colour (a slice experiment's); "
                    "absent: every request", required=False)
_DELAY = FaultKindInfo(
    kind="link-delay", family="network",
    description="the gateway's requests to the replica wait latency_ms (+ up to jitter_ms) before they go",
    params=(ParamInfo("latency_ms", "number", "added delay per request, (0, 60000] ms"),
            ParamInfo("jitter_ms", "number", "extra random delay, [0, 60000] ms", required=False,
                      default=0), _COLOUR))
_ABORT = FaultKindInfo(
    kind="link-abort", family="network",
    description="the gateway's link to the replica fails: new connections are refused (refuse), or every "
                "stream is cut after_ms after it started or after the fault began (reset)",
    params=(ParamInfo("mode", "string", "refuse or reset", required=False, default="refuse"),
            ParamInfo("after_ms", "number", "reset: how long a stream lives, [0, 60000] ms", required=False,
                      default=0), _COLOUR),
    takes_down=True)


class _LinkFault(Fault):
    expires_by_itself = True  # the gateways drop a toxic at its duration
    info: FaultKindInfo

    def __init__(self, link: LinkControl | None) -> None:
        self.link = link

    def describe(self) -> FaultKindInfo:
        if self.link is None:
            return FaultKindInfo(self.info.kind, self.info.family, self.info.description, self.info.params,
                                 self.info.takes_down, available=False,
                                 unavailable_reason="no gateway in this process to apply link toxics")
        return self.info

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        return RevertToken(self.info.kind, target.replica_id, "remove-toxic", {"toxic_id": None})

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        if self.link is None:
            raise FaultError("unavailable: no gateway in this process to apply link toxics")
        toxic = self.toxic(check_params(spec, self.info))
        try:
            toxic_id = await self.link.add(target.replica_id, toxic, duration_s=spec.duration_s)
        except (OSError, ValueError) as exc:
            raise FaultError(f"link toxic not applied: {exc}") from exc
        return RevertToken(self.info.kind, target.replica_id, "remove-toxic", {"toxic_id": toxic_id})

    async def revert(self, token: RevertToken) -> None:
        toxic_id = token.data.get("toxic_id")
        if self.link is not None and isinstance(toxic_id, str):
            await self.link.remove(toxic_id)

    def toxic(self, params: dict[str, Scalar]) -> dict[str, Scalar]:
        raise NotImplementedError


def _number(params: Mapping[str, Scalar], name: str) -> float:
    value = params.get(name, 0)
    assert isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value)


class LinkDelayFault(_LinkFault):
    info = _DELAY

    def validate(self, spec: FaultSpec) -> None:
        params = check_params(spec, self.info)
        if not 0 < _number(params, "latency_ms") <= MAX_LATENCY_MS:
            raise ValueError(f"params.latency_ms: must be in (0, {MAX_LATENCY_MS}]")
        if not 0 <= _number(params, "jitter_ms") <= MAX_LATENCY_MS:
            raise ValueError(f"params.jitter_ms: must be in [0, {MAX_LATENCY_MS}]")

    def toxic(self, params: dict[str, Scalar]) -> dict[str, Scalar]:
        return {"kind": "latency", "latency_s": _number(params, "latency_ms") / 1000,
                "jitter_s": _number(params, "jitter_ms") / 1000, **_coloured(params)}


class LinkAbortFault(_LinkFault):
    info = _ABORT

    def validate(self, spec: FaultSpec) -> None:
        params = check_params(spec, self.info)
        mode = params.get("mode")
        if mode not in ABORT_MODES:
            raise ValueError(f"params.mode: must be one of {', '.join(ABORT_MODES)}, got {mode!r}")
        if not 0 <= _number(params, "after_ms") <= MAX_LATENCY_MS:
            raise ValueError(f"params.after_ms: must be in [0, {MAX_LATENCY_MS}]")

    def toxic(self, params: dict[str, Scalar]) -> dict[str, Scalar]:
        return {"kind": str(params["mode"]), "after_s": _number(params, "after_ms") / 1000,
                **_coloured(params)}


def _coloured(params: Mapping[str, Scalar]) -> dict[str, Scalar]:
    colour = params.get("colour")
    return {} if colour is None else {"colour": colour}


def link_faults(link: LinkControl | None) -> list[Fault]:
    return [LinkDelayFault(link), LinkAbortFault(link)]
