"""``python -m controlplane.bench.busy``: a control plane at its busiest, beside the gateway benchmark.

Where it sits: ``python -m controlplane.bench gateway --control-plane busy`` runs this next to the gateway,
on the gateway's CPUs, while the levels run. It does what a busy control plane does besides answering its
API: what-if simulations back to back, the way the control plane runs them (each in a worker process of
idle priority, :mod:`controlplane.sim.what_if`), and, on its main thread at normal priority, a drill report
derived and rendered every second (the figures of a 30-second drill's client timeline, the verdict, the
Markdown). It runs until it is sent SIGTERM and prints how much of each it did.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from typing import Any

from chaos.drill_figures import ClientRequest, derive_figures, timeline_series, verdict
from chaos.scenarios import SloTarget, scenario
from controlplane.drills.report import to_markdown
from controlplane.sim.what_if import SimulateRequest, run_what_if_process
from controlplane.vocabulary import SYNTHETIC_BURSTY

REPORT_EVERY_S = 1.0
SIM_DURATION_S = 600.0  # simulated seconds per what-if run
TIMELINE_REQUESTS = 120  # a 30 s drill at 4 requests per second


def what_ifs(stop: threading.Event, done: list[int]) -> None:
    """What-if simulations back to back, each in a worker process at batch priority, as the control plane
    runs them (this thread only waits on the worker)."""
    request = SimulateRequest.model_validate(
        {"trace": SYNTHETIC_BURSTY, "duration_s": SIM_DURATION_S, "compress": 1.0, "token_scale": 0.25,
         "policies": ["ours", "hpa", "static:3"], "ttft_slo_s": 1.0, "tpot_slo_s": 0.1})
    while not stop.is_set():
        run_what_if_process(request)
        done[0] += 1


def drill_report(now: float) -> str:
    """One drill report, from a synthetic client timeline: figures, verdict, timeline, Markdown."""
    t0 = now + 10.0
    requests = [ClientRequest(i, now + i * 0.25, now + i * 0.25 + 0.05,
                              tuple(now + i * 0.25 + 0.05 + k * 0.01 for k in range(24)),
                              now + i * 0.25 + 0.3, True, f"r{i % 3}", 24, 24)
                for i in range(TIMELINE_REQUESTS)]
    sc = scenario("replica-crash")
    fig = derive_figures(requests, [], t0=t0, slo=SloTarget(), fault_targets=["r1"])
    checks = verdict(fig, sc.targets)
    report: dict[str, Any] = {"id": 0, "scenario": sc.id, "title": sc.title, "status": "passed",
                              "config": sc.describe(), "figures": fig.relative(),
                              "checks": [dataclasses.asdict(c) for c in checks],
                              "timeline": timeline_series(requests, [], t0)}
    return to_markdown(report)


def main() -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    simulations = [0]
    threading.Thread(target=what_ifs, args=(stop, simulations), name="what-if", daemon=True).start()
    reports = 0
    while not stop.is_set():
        drill_report(time.time())
        reports += 1
        stop.wait(REPORT_EVERY_S)
    print(f"busy control plane: {simulations[0]} what-if runs, {reports} drill reports", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
