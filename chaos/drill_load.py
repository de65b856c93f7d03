"""A drill's load client: its command line, how the plan and the report describe it, and why it did not start.

The load is ``python -m inference.bench serve`` in a process of its own, at the scenario's rate (Poisson
arrivals) or replaying a trace window with its own arrivals and token counts.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Protocol

import psutil

from chaos.scenarios import LoadProfile, Scenario

LOAD_GRACE_S = 10.0  # in-flight requests get this long after the load's duration


def load_command(sc: Scenario, gateway_url: str, workdir: Path) -> list[str]:
    """The load client's command line (``python -m inference.bench serve``) for the scenario's load."""
    cmd = [sys.executable, "-m", "inference.bench", "serve", "--base-url", gateway_url,
           "--duration", f"{sc.duration_s:g}", "--grace", f"{LOAD_GRACE_S:g}", "--seed", "0",
           "--request-timeout", "60", "--jsonl", str(workdir / "load.jsonl"),
           "--result-json", str(workdir / "load-summary.json"), "--no-progress"]
    profile = sc.load
    if profile.is_trace:  # trace arrivals (no --request-rate) over the window the load lasts
        return [*cmd, "--dataset", f"trace:{profile.path}", "--time-scale", repr(profile.compress),
                "--token-scale", repr(profile.token_scale), "--trace-start", repr(profile.trace_start_s),
                "--trace-duration", repr(sc.duration_s * profile.compress),
                "--max-input-len", str(profile.max_input_len), "--max-output-len", str(sc.max_tokens)]
    num = math.ceil(sc.rate * sc.duration_s * 2) + 10  # Poisson: enough never to run dry
    return [*cmd, "--num-requests", str(num), "--request-rate", f"{sc.rate:g}",
            "--input-len", str(sc.input_len), "--output-len", str(sc.max_tokens)]


def describe_load(sc: Scenario) -> dict[str, Any]:
    """The load as the plan and the report show it."""
    profile: LoadProfile = sc.load
    if not profile.is_trace:
        return {"kind": "rate", "rate": sc.rate, "duration_s": sc.duration_s}
    return {"kind": "trace", "trace": profile.trace, "path": profile.path, "compress": profile.compress,
            "token_scale": profile.token_scale, "trace_start_s": profile.trace_start_s,
            "trace_window_s": round(sc.duration_s * profile.compress, 4), "requests": profile.requests,
            "mean_rate": sc.rate, "duration_s": sc.duration_s, "max_input_len": profile.max_input_len,
            "max_output_len": sc.max_tokens}


class LoadProcess(Protocol):
    """A load client's process: asyncio's, or ``subprocess.Popen`` (after ``poll()``)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...


def load_not_started(load: LoadProcess | None, log: Path, *, waited_s: float) -> str:
    """Why a drill's load client never put a stream in flight, from its exit status and its log (it writes
    a line when it asks for the model and one when it starts sending; ``inference.bench.load_client``)."""
    lines = _tail(log)
    said = f"; its last line: {lines[-1]!r}" if lines else ""
    if load is None:
        return "the load client was not started"
    if load.returncode is not None:
        return f"the load client exited with status {load.returncode} before any stream{said}"
    cpu = _cpu_seconds(load.pid)
    used = "" if cpu is None else f", {cpu:.1f} s of CPU used"
    busy = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    if not lines:
        return (f"the load client (pid {load.pid}) was still starting after {waited_s:.0f} s: it had written "
                f"nothing, not even its request for the model ({busy}{used})")
    if not any(" requests to " in line for line in lines):
        return (f"the load client (pid {load.pid}) had not started sending after {waited_s:.0f} s: it was "
                f"still asking the gateway for its model{said}")
    return (f"the load client (pid {load.pid}) was sending, but the gateway showed no stream in flight for "
            f"{waited_s:.0f} s (its requests were refused before routing, or ended before the gateway's "
            f"state was read){said}")


def _tail(log: Path, max_bytes: int = 4096) -> list[str]:
    try:
        with log.open("rb") as f:
            f.seek(max(log.stat().st_size - max_bytes, 0))
            return [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return []


def _cpu_seconds(pid: int) -> float | None:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)
