"""Where a live run's autoscaler stood when the load began, read from its decision records, so that the
simulated loop of ``python -m controlplane.bench sim-vs-live`` starts there: the same load samples (the
probe before the slice is a change of load the steady load remembers for four windows), the last queue,
the ready replicas and since when, the live loop's first tick after the load's start (its phase), and
the span its panic window's rate counts (the span between the window's first and last scrapes, 4 of the
6 s at a 2 s scrape interval: on a ramp the last 4 s run faster than the whole 6).
A simulated loop that starts fresh fits a trend to the ramp's first windows where the live one, still
within four windows of the probe, takes each window's own rate: on the same slice the two then scale a
tick or two apart, and P95 TTFT, decided by the queue of those seconds, differs by a third. Pure: the
records in, the start out.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.autoscale.decide import LoopState, ready_since
from controlplane.autoscale.load import LoadSample, remember
from controlplane.autoscale.policies import History
from controlplane.client import Decision


@dataclass(slots=True, frozen=True)
class LoopStart:
    """The live loop at the load's start, in seconds since it (before: negative)."""

    prior: LoopState  # its load samples, last queue per replica and ready replicas (history left empty)
    first_tick_s: float | None  # its first tick at or after the start; None: it never ticked after
    # the seconds of arrivals its panic window's rate counted after the start (the span between the
    # window's first and last scrapes; the median over its ticks); None: not recorded
    panic_counted_s: float | None = None

    def describe(self) -> str:
        load = self.prior.load
        since = "" if not load else f" since its last change at {load[0].at:+.0f}s" if load[0].change \
            else f" from {load[0].at:+.0f}s"
        ready = "" if self.prior.ready is None else (
            f", {self.prior.ready[0]} ready since {self.prior.ready[1]:+.0f}s")
        tick = "" if self.first_tick_s is None else f"; first tick {self.first_tick_s:.2f}s after the start"
        counted = "" if self.panic_counted_s is None else \
            f"; panic window's rate over its last {self.panic_counted_s:g}s"
        return f"{len(load)} load samples{since}{ready}{tick}{counted}"


def loop_start(decisions: Sequence[Decision], start: float, *, keep_s: float) -> LoopStart:
    """The loop's state once the records before ``start`` (POSIX seconds) were decided, rebuilt as the loop
    built it: each record's load sample remembered (``remember``, over the stabilization window
    ``keep_s``), its queue, and its ready replicas with since when (``ready_since``, as the loop keeps
    them)."""
    load: tuple[LoadSample, ...] = ()
    ready: tuple[int, float] | None = None
    waiting: float | None = None
    for d in sorted((d for d in decisions if d.at < start), key=lambda d: d.at):
        at, inputs = d.at - start, d.inputs
        ready = (inputs.ready, ready_since(inputs.ready, at, ready))
        waiting = inputs.metrics.get("waiting_per_replica")
        if inputs.request_rate is not None:
            sample = LoadSample(at, inputs.request_rate, inputs.mean_prompt_tokens, inputs.mean_output_tokens)
            load = remember(load, sample, changed=inputs.load_changed, window_s=inputs.rate_window_s,
                            keep_s=keep_s)
    after = [d for d in decisions if d.at >= start]
    counted = [c for d in after if (c := d.inputs.panic_counted_s) is not None]
    return LoopStart(LoopState(History(keep_s, ()), waiting=waiting, load=load, ready=ready),
                     min(d.at for d in after) - start if after else None,
                     statistics.median(counted) if counted else None)
