"""The ``partition`` fault kind: a replica's port cut off by an eBPF filter, on loopback for a replica of
this machine, on the interface that reaches its host otherwise (the lab's bridge for a lab host).

The common fault verbs (validate, prepare, inject, revert, describe) around :class:`PortPartition`, which
does the kernel work. The revert record holds the partition record (with its interface) as JSON, so a new
control plane can remove a filter that a crashed one left behind.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

from chaos.faults.base import (
    Fault,
    FaultError,
    FaultKindInfo,
    FaultSpec,
    RevertFailed,
    RevertToken,
    check_params,
)
from chaos.faults.network import PartitionError, PortPartition, availability, route_interface
from chaos.targets import Target

KIND = "partition"


class PartitionFault(Fault):
    def __init__(self, partition: PortPartition | None = None) -> None:
        self.partition = partition or PortPartition()

    def describe(self) -> FaultKindInfo:
        ok, reason = availability()
        return FaultKindInfo(kind=KIND, family="network", takes_down=True, available=ok,
                             unavailable_reason=reason,
                             description="drop TCP to and from the replica's port (eBPF, tc clsact on the "
                                         "interface that reaches it: lo for this machine): new connections "
                                         "time out, open ones stall")

    def validate(self, spec: FaultSpec) -> None:
        if spec.kind != KIND:
            raise ValueError(f"kind: expected {KIND!r}, got {spec.kind!r}")
        check_params(spec, self.describe())

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        try:
            record = self.partition.prepare(target.port, _interface(target))
        except (PartitionError, ValueError) as exc:
            raise FaultError(f"{target.replica_id}: {exc}") from exc
        return _token(target.replica_id, record)

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        self.validate(spec)
        try:  # bcc compiles the program with clang: seconds of CPU, kept off the event loop
            record = await asyncio.to_thread(self.partition.inject, target.port, _interface(target))
        except (PartitionError, ValueError) as exc:
            raise FaultError(f"{target.replica_id}: {exc}") from exc
        return _token(target.replica_id, record)

    async def revert(self, token: RevertToken) -> None:
        try:
            record = json.loads(str(token.data["record"]))
            await asyncio.to_thread(self.partition.revert, record)
        except (KeyError, ValueError) as exc:
            raise RevertFailed(f"{token.target}: malformed revert token", retryable=False) from exc
        except PartitionError as exc:
            raise RevertFailed(f"{token.target}: {exc}", retryable=True) from exc


def _interface(target: Target) -> str:
    """The interface this machine reaches the target's host through (its admin URL names the host)."""
    host = urlsplit(target.admin_url).hostname
    if not host:
        raise ValueError(f"admin_url: no host in {target.admin_url!r}")
    return route_interface(host)


def _token(replica_id: str, record: dict[str, object]) -> RevertToken:
    return RevertToken(kind=KIND, target=replica_id, action="remove_filter",
                       data={"record": json.dumps(record, sort_keys=True)})


def faults() -> list[Fault]:
    """The catalogue's hook for optional fault modules."""
    return [PartitionFault()]
