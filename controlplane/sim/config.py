"""``[simulator]``: how the what-ifs asked of the control plane (REST and console) run on its host.

``cpu_priority = "idle"`` (the default): the worker runs under ``SCHED_IDLE`` and nice 10, so anything of
normal priority preempts it at once; on a host whose cores stay busy (replicas serving flat out) a what-if
runs only in the gaps and can take minutes. ``"low"``: nice 10 alone, so a what-if gets about a tenth of
a busy core's time (weight 110 against 1,024) and ends in bounded time, for a little more latency on the
data plane where they share cores (the gateway benchmark measured 1.65-3.37 ms added P50 TTFT at 16 streams
under nice 10 alone, against 0.11-1.78 ms under ``SCHED_IDLE``).
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_PRIORITIES = ("idle", "low")


@dataclass(slots=True)
class SimulatorConfig:
    cpu_priority: str = "idle"  # idle: SCHED_IDLE and nice 10; low: nice 10 alone


def simulator_problems(cfg: SimulatorConfig) -> list[tuple[str, str]]:
    if cfg.cpu_priority not in CPU_PRIORITIES:
        return [("simulator.cpu_priority", f"must be one of {', '.join(CPU_PRIORITIES)}, "
                                           f"got {cfg.cpu_priority!r}")]
    return []
