"""What a drill needs from the control plane (:class:`DrillPort`) and how a drill fails (:class:`DrillError`
and its kinds, each mapped by the API to its HTTP status through :mod:`chaos.errors`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from chaos.drill_figures import FleetSample, Timings
from chaos.errors import ChaosError, Conflict, Unavailable
from chaos.targets import Target


class DrillError(ChaosError):
    """A drill could not start or could not finish; the message says why. Inside a run it ends the run,
    whose report keeps it as ``error`` (status "error")."""


class DrillBusy(DrillError, Conflict):
    """A drill is running already: one at a time."""


class NoTarget(DrillError, Conflict):
    """The replica or zone the drill is aimed at is not in the fleet (any more)."""


class FaultNotInjected(DrillError):
    """A fault of the scenario did not go in; the drill stops and reverts what did (the cause is chained)."""


class LoadFailed(DrillError):
    """The load client did not drive the drill: it exited early or wrote no records (see its log)."""


class LoadNotFlowing(LoadFailed, Unavailable):
    """The load never reached the gateway in time (a busy machine, a gateway not serving): try again."""


class DrillAborted(DrillError):
    """The drill was aborted by an operator."""


class DrillPort(Protocol):
    """The control plane as a drill needs it (``controlplane.drills.port.FleetDrillPort`` satisfies it)."""

    @property
    def gateway_url(self) -> str: ...

    def fleet_sample(self) -> FleetSample: ...

    def inflight(self) -> Mapping[str, int]:
        """The gateway's streams in flight per replica id, as last read (see :meth:`refresh_inflight`)."""
        ...

    async def refresh_inflight(self) -> None:
        """Read the gateways' streams in flight now. A drill aims at live streams, and a stream lasts
        about a second: a view read every half second would often aim at one that has already ended."""
        ...

    def targets(self) -> Sequence[Target]: ...

    def timings(self) -> Timings: ...

    def start_rollout(self) -> str:
        """Start a rolling update under load; returns the model rolled out to."""
        ...

    def resumes_between(self, start_wall: float, end_wall: float) -> int: ...

    def kill_gateway(self) -> str:
        """``kill -9`` one gateway process (gateway-crash); its name."""
        ...

    def write_marks(self, drill_id: str, n: int) -> list[int]: ...

    async def run_slice_experiment(self, spec: Mapping[str, Any], by: str) -> dict[str, Any]:
        """Run a slice experiment (slice-experiment scenarios) to its end; its record."""
        ...

    def count_marks(self, ids: Sequence[int]) -> int: ...
