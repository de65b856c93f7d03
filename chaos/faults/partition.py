"""The ``partition`` fault kind: a replica's port cut off on loopback by an eBPF filter.

The common fault verbs (validate, prepare, inject, revert, describe) around :class:`PortPartition`, which
does the kernel work. The revert record holds the partition record as JSON, so a new control plane can
remove a filter that a crashed one left behind.
"""

from __future__ import annotations

import asyncio
import json

from chaos.faults.base import (
    Fault,
    FaultError,
    FaultKindInfo,
    FaultSpec,
    RevertFailed,
    RevertToken,
    check_params,
)
from chaos.faults.network import PartitionError, PortPartition, availability
from chaos.targets import Target

KIND = "partition"


class PartitionFault(Fault):
    def __init__(self, partition: PortPartition | None = None) -> None:
        self.partition = partition or PortPartition()

    def describe(self) -> FaultKindInfo:
        ok, reason = availability()
        return FaultKindInfo(kind=KIND, family="network", takes_down=True, available=ok,
                             unavailable_reason=reason,
                             description="drop TCP to and from the replica's port on loopback (eBPF, tc "
                                         "clsact on lo): new connections time out, open ones stall")

    def validate(self, spec: FaultSpec) -> None:
        if spec.kind != KIND:
            raise ValueError(f"kind: expected {KIND!r}, got {spec.kind!r}")
        check_params(spec, self.describe())

    def prepare(self, spec: FaultSpec, target: Target) -> RevertToken:
        try:
            record = self.partition.prepare(target.port)
        except (PartitionError, ValueError) as exc:
            raise FaultError(f"{target.replica_id}: {exc}") from exc
        return _token(target.replica_id, record)

    async def inject(self, spec: FaultSpec, target: Target) -> RevertToken:
        self.validate(spec)
        try:  # bcc compiles the program with clang: seconds of CPU, kept off the event loop
            record = await asyncio.to_thread(self.partition.inject, target.port)
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


def _token(replica_id: str, record: dict[str, object]) -> RevertToken:
    return RevertToken(kind=KIND, target=replica_id, action="remove_filter",
                       data={"record": json.dumps(record, sort_keys=True)})


def faults() -> list[Fault]:
    """The catalogue's hook for optional fault modules."""
    return [PartitionFault()]
