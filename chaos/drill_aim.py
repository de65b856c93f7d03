"""Where a drill's faults go: the caller's replicas or zones checked against the fleet, and resolved there.

A single-replica fault hits the replica the caller named, else the busiest one (most streams in flight) of
the named zone or of the fleet; a zone fault hits every replica of the named zone, else of the busiest
replica's zone. A rollout touches every replica; the platform-crash drills aim at a process, not a replica.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chaos.scenarios import Scenario
from chaos.targets import Target


@dataclass(slots=True, frozen=True)
class Aim:
    """Where a drill's faults go: what the caller asked for, and what that is in the fleet now."""

    requested_replicas: tuple[str, ...]
    requested_zones: tuple[str, ...]
    replicas: tuple[str, ...]  # resolved: the replicas the faults hit
    zones: tuple[str, ...]
    how: str

    def requested(self) -> dict[str, Any]:
        return {"replicas": list(self.requested_replicas), "zones": list(self.requested_zones)}

    def resolved(self) -> dict[str, Any]:
        return {"replicas": list(self.replicas), "zones": list(self.zones), "how": self.how}


def check_aim(sc: Scenario, targets: Sequence[Target]) -> None:
    """ValueError naming ``replicas`` or ``zones`` when the caller's names are not in the fleet."""
    by_id = {t.replica_id: t for t in targets}
    zones = sorted({t.zone for t in targets})
    for replica_id in sc.replicas:
        if replica_id not in by_id:
            raise ValueError(f"replicas: no replica {replica_id!r} in the fleet "
                             f"(running: {', '.join(sorted(by_id)) or 'none'})")
    for zone in sc.zones:
        if zone not in zones:
            raise ValueError(f"zones: no replica of the fleet in zone {zone!r} "
                             f"(zones: {', '.join(zones) or 'none'})")
    for replica_id in sc.replicas:
        if sc.zones and by_id[replica_id].zone not in sc.zones:
            raise ValueError(f"zones: replica {replica_id} is in zone {by_id[replica_id].zone}, "
                             f"not {', '.join(sc.zones)}")


def resolve_aim(sc: Scenario, targets: Sequence[Target], inflight: Mapping[str, int]) -> Aim:
    """The scenario's aim in the fleet ``targets`` with ``inflight`` streams per replica (see the module
    docstring); ValueError when the caller's names are not in the fleet or the fleet is empty."""
    check_aim(sc, targets)
    asked = (sc.replicas, sc.zones)
    if sc.action == "rollout":
        ids = tuple(sorted(t.replica_id for t in targets))
        return Aim(*asked, ids, tuple(sorted({t.zone for t in targets})), "every replica, one at a time")
    if sc.action in ("gateway-crash", "control-plane-crash"):
        return Aim(*asked, (), (), "one gateway process" if sc.action == "gateway-crash" else
                   "the control plane process")
    if sc.replicas:
        replica = next(t for t in targets if t.replica_id == sc.replicas[0])
        how = f"replica {replica.replica_id} (named)"
    elif sc.zones:
        replica = _busiest([t for t in targets if t.zone == sc.zones[0]], inflight)
        how = f"the busiest replica of zone {sc.zones[0]} (named): {replica.replica_id}"
    else:
        replica = _busiest(targets, inflight)
        how = f"the busiest replica: {replica.replica_id}"
    if not sc.takes_zone:
        return Aim(*asked, (replica.replica_id,), (replica.zone,), how)
    zone = sc.zones[0] if sc.zones else next((f.zone for f in sc.faults if f.zone and f.zone != "first"),
                                               replica.zone)
    how = f"zone {zone} (named)" if sc.zones else f"zone {zone}, of the busiest replica {replica.replica_id}"
    ids = tuple(sorted(t.replica_id for t in targets if t.zone == zone))
    return Aim(*asked, ids, (zone,), how)


def _busiest(targets: Sequence[Target], inflight: Mapping[str, int]) -> Target:
    """The target with the most streams in flight; ties (and no traffic) go to the first zone, then id."""
    if not targets:
        raise ValueError("targets: the fleet has no replica to aim at")
    return min(targets, key=lambda t: (-inflight.get(t.replica_id, 0), t.zone, t.replica_id))
