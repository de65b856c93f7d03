"""The simulator against the live fleet, short (the CI's version of ``python -m controlplane.bench
sim-vs-live``): 90 s of an Azure trace slice through a real ``controlplane up`` that starts at 1 replica
and must scale, and through the simulator with the same profile, autoscaler configuration and requests.

The bounds are looser than the benchmark's targets (5 points, 15%, 25% over 300 s): over 90 s one scale-up
that comes a tick or a scrape later live than simulated moves replica-seconds by several percent, and the
live loop's first rates are over a window that still holds the idle time before the load. Attainment is
only judged on a host that other work left alone: the simulator gives the replicas the host's cores, and
a busy host (2 cores here) takes them, which queues requests live that the simulator serves at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from controlplane.bench.sim_vs_live import leftover_pids

DURATION_S = 90.0
# From 450 s of the trace, twice as fast (about 10 requests/s): the simulated fleet scales 1 -> 2 about
# 40 s in, so the live one has time to scale within the run.
TRACE_START_S, COMPRESS = 450.0, 2.0
BOUND_S = 280.0
# The simulator shares the host's cores among the replicas only (``host_cores``): attainment is judged
# when the rest of the host (other work, not this run's processes) used at most this share of them.
QUIET = 0.2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(BOUND_S) + 60)]


def test_a_short_live_run_scales_and_the_simulator_stays_close(tmp_path: Path) -> None:
    out, html, workdir = tmp_path / "svl.json", tmp_path / "svl.html", tmp_path / "run"
    started = time.monotonic()
    command = [sys.executable, "-m", "controlplane.bench", "sim-vs-live", "--duration", f"{DURATION_S:g}",
               "--trace-start", f"{TRACE_START_S:g}", "--compress", f"{COMPRESS:g}",
               "--workdir", str(workdir), "--json", str(out), "--html", str(html)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=BOUND_S)
    print(run.stdout[-4000:], f"\ntook {time.monotonic() - started:.0f}s")
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]  # 1: a tight target missed
    assert leftover_pids(workdir / "state") == []
    result = json.loads(out.read_text())
    assert result["leftover_pids"] == []
    live, sim = result["live"], result["sim"]
    assert live["num_requests"] == sim["num_requests"] > 0  # the same requests (the bench checks tokens too)
    assert live["scale_events"] >= 1 and max(n for _, n in live["timeline"]) >= 2  # the live fleet scaled
    assert sim["scale_events"] >= 1
    assert abs(sim["replica_seconds"] - live["replica_seconds"]) <= 0.35 * live["replica_seconds"]
    cpu = result["cpu"]
    if cpu["rest of the host"] <= QUIET * cpu["available"]:
        assert abs(sim["slo_attainment"] - live["slo_attainment"]) * 100 <= 15
    else:  # the replicas did not get the cores the simulator gives them: latencies are not comparable
        warnings.warn(f"attainment not judged: the rest of the host used {cpu['rest of the host']} of "
                      f"{cpu['available']} core-seconds while the load ran", stacklevel=1)
    assert "attainment: " in run.stdout and "replica_seconds: " in run.stdout and "ttft_p95: " in run.stdout
    assert "plotly" in html.read_text()
