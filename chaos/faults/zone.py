"""The ``zone-outage`` fault kind: every replica of one zone goes down at once.

Four modes. ``kill`` SIGKILLs every replica process of the zone; the fleet restarts them, so revert only
records (the token keeps pid and start time for the record). ``partition`` cuts every replica's port off
on loopback with the eBPF :class:`~chaos.faults.network.PortPartition`; revert removes each filter, and the
token holds the partition record so a new control plane can remove what a crashed one left. On a cluster
(:mod:`chaos.faults.cluster`), ``node-loss`` stops every node of the zone and ``link-down`` cuts every
node's link (the lab); revert starts them again, or brings the links up.

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
from chaos.faults.cluster import ClusterControl, NodeLossFault, NodePartitionFault
from chaos.faults.network import availability
from chaos.faults.partition import PartitionFault
from chaos.faults.process import ProcessFault
from chaos.targets import Target

KIND = "zone-outage"
MODES = ("kill", "partition", "node-loss", "link-down")
_CLUSTER_MODES = {"node-loss": "node-loss", "link-down": "node-partition"}  # mode -> the cluster fault kind


class ZoneOutageFault(Fault):
    def __init__(self, *, killer: ProcessFault | None = None, partition: PartitionFault | None = None,
                 cluster: ClusterControl | None = None) -> None:
        self._killer = killer or ProcessFault("kill")
        self._partition = partition or PartitionFault()
        self._cluster = {"node-loss": NodeLossFault(cluster), "node-partition": NodePartitionFault(cluster)}
        self._has_cluster = cluster is not None

    def describe(self) -> FaultKindInfo:
        ebpf_ok, reason = availability()
        modes = "kill (SIGKILL, the fleet restarts them)" + (
            ", partition (eBPF port partition)" if ebpf_ok else f"; partition mode {reason}")
        modes += ", node-loss (every node of the zone stops), link-down (every node's link cut)" \
            if self._has_cluster else "; node-loss and link-down need a cluster (fleet.backend = \"ray\")"
        return FaultKindInfo(
            kind=KIND, family="zone", takes_down=True,
            description=f"take down every replica of one zone: {modes}",
            params=(ParamInfo("zone", "string", "the zone to take down, e.g. az-a"),
                    ParamInfo("mode", "string", ", ".join(MODES), required=False, default="kill")))

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
        if params["mode"] in _CLUSTER_MODES and not self._has_cluster:
            raise FaultUnavailable(f"params.mode: {params['mode']} needs a cluster (fleet.backend = \"ray\")")

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
        if isinstance(mode, str) and mode in _CLUSTER_MODES:
            kind = _CLUSTER_MODES[mode]
            data = {k: v for k, v in token.data.items() if k not in ("mode", "zone")}
            await self._cluster[kind].revert(RevertToken(kind, token.target, token.action, data))
            return
        if mode != "partition" or token.action != "remove_filter":
            raise RevertFailed(f"{token.target}: malformed zone-outage token {token.to_json()!r}",
                               retryable=False)
        data = {k: v for k, v in token.data.items() if k not in ("mode", "zone")}
        await self._partition.revert(RevertToken("partition", token.target, token.action, data))

    def _inner(self, spec: FaultSpec) -> Fault:
        mode = str(spec.params.get("mode", "kill"))
        if mode in _CLUSTER_MODES:
            return self._cluster[_CLUSTER_MODES[mode]]
        return self._partition if mode == "partition" else self._killer

    def _inner_spec(self, spec: FaultSpec) -> FaultSpec:
        mode = str(spec.params.get("mode", "kill"))
        if mode in _CLUSTER_MODES:  # every node of the zone, whichever replica of it is the target
            return FaultSpec(kind=_CLUSTER_MODES[mode], params={"scope": "zone"}, duration_s=spec.duration_s,
                             selector=spec.selector)
        kind = "partition" if mode == "partition" else "kill"
        return FaultSpec(kind=kind, duration_s=spec.duration_s, selector=spec.selector)


def _wrap(inner: RevertToken, spec: FaultSpec) -> RevertToken:
    mode = str(spec.params.get("mode", "kill"))
    data = {**inner.data, "mode": mode, "zone": str(spec.params["zone"])}
    return RevertToken(kind=KIND, target=inner.target, action=inner.action, data=data)


def describe_token(token: RevertToken) -> str:
    """One line for logs and the console."""
    if token.data.get("mode") in _CLUSTER_MODES:
        return f"{token.target}: {token.data.get('mode')} of zone {token.data.get('zone')}"
    if token.data.get("mode") == "partition":
        record = json.loads(str(token.data.get("record", "{}")))
        return f"{token.target}: port {record.get('port')} partitioned (zone {token.data.get('zone')})"
    return f"{token.target}: killed pid {token.data.get('pid')} (zone {token.data.get('zone')})"


def faults(cluster: ClusterControl | None = None) -> list[Fault]:
    """The catalogue's hook for optional fault modules."""
    return [ZoneOutageFault(cluster=cluster)]
