"""Where the gateway bench's processes run: CPUs for the replica, the gateway and the load client.

Where it sits: :mod:`controlplane.bench.gateway` picks a :class:`CpuLayout` before it starts the replica and
the gateway, and runs its load client's event loop under :func:`load_thread`; the report
(:mod:`controlplane.bench.report`) names both, since they change what is measured.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

GatewayMode = Literal["process", "thread"]  # the gateway in its own process, or on a thread of the client
LayoutKind = Literal["pinned", "shared"]


@dataclass(slots=True, frozen=True)
class CpuLayout:
    """``pinned``: the replica on its own CPUs (the upper half), the gateway and the load client on the
    others. A replica's model runs on an accelerator, not on the cores that serve HTTP; on a CPU-only
    machine whose replica computes on every core, the gateway's CPU time would instead come out of the
    model's matrix products, and what the benchmark measured would be the core count. The load client
    stays off the replica's CPUs too: there, each chunk the gateway sends it from another CPU waits for
    the model's compute to yield (about 2 ms at one stream), a delay the direct route, woken from the
    replica's own CPU, does not see. ``shared``: all three wherever the scheduler puts them (the only
    choice with one usable CPU)."""

    kind: LayoutKind
    replica: tuple[int, ...] = ()
    front: tuple[int, ...] = ()  # the gateway and the load client

    @classmethod
    def choose(cls, kind: LayoutKind) -> CpuLayout:
        usable = sorted(os.sched_getaffinity(0))
        if kind == "shared" or len(usable) < 2:
            return cls("shared")
        half = len(usable) // 2
        return cls("pinned", tuple(usable[half:]), tuple(usable[:half]))

    def describe(self) -> str:
        if self.kind == "shared":
            return "shared (replica, gateway and load client on any CPU)"
        return (f"pinned (replica on CPUs {cpu_list(self.replica)}; gateway and load client on "
                f"{cpu_list(self.front)})")


def cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus))


@contextlib.contextmanager
def load_thread(cpus: Sequence[int]) -> Iterator[str]:
    """This thread (the load client's event loop) on ``cpus`` (when any) and under ``SCHED_BATCH`` for
    the block; yields the scheduling policy it runs under, for the report.

    The load client stands in for clients on other machines, yet shares its CPU with the gateway. Under
    the default policy a task woken by a socket preempts the one running, so each chunk the gateway
    writes stopped the gateway mid-relay to let the client read it: about 900 times a second at 64
    streams, and the gateway spent about a fifth more CPU per request (1.12 against 0.91 ms) switching
    back and forth. ``SCHED_BATCH`` tasks do not preempt on wake-up; they still get their fair share of
    the CPU. On the direct route the client's CPU is otherwise idle, so nothing changes there."""
    before_cpus = os.sched_getaffinity(0) if cpus else None
    before_policy = os.sched_getscheduler(0)
    policy = "default"
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        policy = "SCHED_BATCH"
    except (AttributeError, OSError) as exc:
        policy = f"default (SCHED_BATCH unavailable: {exc})"
    try:
        yield policy
    finally:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, before_policy, os.sched_param(0))
        if before_cpus is not None:
            os.sched_setaffinity(0, before_cpus)


SHARED = CpuLayout("shared")
