"""The ``zone-outage`` fault kind: every replica of one zone goes down at once.

Two modes. ``kill`` SIGKILLs every replica process of the zone; the fleet restarts them, so revert only
records (the token keeps pid and start time for the record). ``partition`` cuts every replica's port off
on loopback with the eBPF :class:`~chaos.faults.network.PortPartition`; revert removes each filter, and the
token holds the partition record so a new control plane can remove what a crashed one left.

The targets come from the ``zone`` parameter, not from the selector: :meth:`ZoneOutageFault.select` is the
hook :meth:`chaos.safety.FaultManager.plan` uses, so the blast-radius check still sees the whole zone and
refuses a zone that holds every replica unless the caller passes ``allow_all``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from chaos.faults.base import (
    Fault,
    FaultKindInfo,
    FaultSpec,
    FaultUnavailable,
    ParamInfo,
    RevertFailed,
    RevertToken,
    check_params,
)
from chaos.faults.network import availability
from chaos.faults.partition import PartitionFault
from chaos.faults.process import ProcessFault
from chaos.targets import Target

KIND = "zone-outage"
MODES = ("kill", "partition")


class ZoneOutageFault(Fault):
    def __init__(self, *, killer: ProcessFault | None = None,
                 partition: PartitionFault | None = None) -> None:
        self._killer = killer or ProcessFault("kill")
        self._partition = partition or PartitionFault()

    def describe(self) -> FaultKindInfo:
        ebpf_ok, reason = availability()
        modes = "kill (SIGKILL, the fleet restarts them)" + (
            ", partition (eBPF port partition)" if ebpf_ok else f"; partition mode {reason}")
        return FaultKindInfo(
            kind=KIND, family="zone", takes_down=True,
            description=f"take down every replica of one zone: {modes}",
            params=(ParamInfo("zone", "string", "the zone to take down, e.g. az-a"),
                    ParamInfo("mode", "string", "kill or partition", required=False, default="kill")))

    def validate(self, spec: FaultSpec) -> None:
        if spec.kind != KIND:
            raise ValueError(f"kind: expected {KIND!r}, got {spec.kind!r}")
        params = check_params(spec, self.describe())
        if not str(params["zone"]).strip():
            raise ValueError("params.zone: must not be empty")
        if params["mode"] not in MODES:
            raise ValueError(f"params.mode: must be one of {', '.join(MODES)}, got {params['mode']!r}")
        if params["mode"] == "partition":
            ok, reason = availability()
            if not ok:
                raise FaultUnavailable(f"params.mode: partition is {reason}")

    def select(self, spec: FaultSpec, targets: Sequence[Target]) -> tuple[Target, ...]:
        """Every target in the zone, sorted by replica id; ValueError naming the zones that exist."""
        zone = str(spec.params["zone"])
        chosen = sorted((t for t in targets if t.zone == zone), key=lambda t: t.replica_id)
        if not chosen:
            known = ", ".join(sorted({t.zone for t in targets})) or "none"
            raise ValueError(f"params.zone: no replica in zone {zone!r} (zones: {known})")
        return tuple(chosen)

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        inner = self._inner(spec).prepare(self._inner_spec(spec), target)
        return _wrap(inner, spec)

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        self.validate(spec)
        if target.zone != spec.params["zone"]:
            raise ValueError(f"{target.replica_id}: in zone {target.zone!r}, not {spec.params['zone']!r}")
        inner = await self._inner(spec).inject(self._inner_spec(spec), target)
        return _wrap(inner, spec)

    async def revert(self, token: RevertToken) -> None:
        mode = token.data.get("mode")
        if token.action == "none":
            return
        if mode != "partition" or token.action != "remove_filter":
            raise RevertFailed(f"{token.target}: malformed zone-outage token {token.to_json()!r}",
                               retryable=False)
        data = {k: v for k, v in token.data.items() if k not in ("mode", "zone")}
        await self._partition.revert(RevertToken("partition", token.target, token.action, data))

    def _inner(self, spec: FaultSpec) -> Fault:
        return self._partition if spec.params.get("mode", "kill") == "partition" else self._killer

    def _inner_spec(self, spec: FaultSpec) -> FaultSpec:
        kind = "partition" if spec.params.get("mode", "kill") == "partition" else "kill"
        return FaultSpec(kind=kind, duration_s=spec.duration_s, selector=spec.selector)


def _wrap(inner: RevertToken, spec: FaultSpec) -> RevertToken:
    mode = str(spec.params.get("mode", "kill"))
    data = {**inner.data, "mode": mode, "zone": str(spec.params["zone"])}
    return RevertToken(kind=KIND, target=inner.target, action=inner.action, data=data)


def describe_token(token: RevertToken) -> str:
    """One line for logs and the console."""
    if token.data.get("mode") == "partition":
        record = json.loads(str(token.data.get("record", "{}")))
        return f"{token.target}: port {record.get('port')} partitioned (zone {token.data.get('zone')})"
    return f"{token.target}: killed pid {token.data.get('pid')} (zone {token.data.get('zone')})"


def faults() -> list[Fault]:
    """The catalogue's hook for optional fault modules."""
    return [ZoneOutageFault()]
