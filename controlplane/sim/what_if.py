"""A what-if run: its request, the run itself, and the worker process the control plane runs it in.

Where it sits: ``POST /api/v1/simulate`` and ``/api/v1/simulations`` (:mod:`controlplane.api.simulations`)
take a :class:`SimulateRequest` and hand it to :func:`run_what_if_process`, which runs :func:`run_what_if`
in a process of its own, ``python -m controlplane.sim.what_if``, at batch CPU priority
(:mod:`controlplane.sim.batch`; ``SCHED_IDLE`` unless ``[simulator] cpu_priority`` says otherwise).
Not a thread of the control plane: a thread under ``SCHED_IDLE`` holds the interpreter's lock while it
computes, and on a host whose cores are busy with normal work it waits for a gap to run again and let the
lock go, so the control plane's own loops and API would wait with it.
Measured on this 2-core machine with two CPU hogs: a normal thread of the same process woke 1.35 s late
(p50) while an idle-priority thread computed beside it, against 0.10 ms without it. A process of its own
shares no lock with anything.

The worker reads each request as a JSON line on stdin, writes its progress and then its result (or its
error) as JSON lines on stdout, waits for the next (kept idle for a while, :mod:`controlplane.sim.batch`),
and exits at once when its stdin closes: a control plane that stops, even by ``kill -9``, takes its
what-if with it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from controlplane.sim.batch import run_batch_process, serve_batch_work
from controlplane.sim.config import CPU_PRIORITIES
from controlplane.vocabulary import (
    AZURE_TRACE,
    DEFAULT_POLICIES,
    SIMULATION_TRACES,
    SYNTHETIC_BURSTY,
)
from inference.bench.datasets import trace_file

MAX_REQUESTS = 50_000
MAX_DURATION_S = 4 * 3600.0
WORKER = "controlplane.sim.what_if"

Progress = Callable[[float, str], None]  # fraction of all policies' runs done (0..1), the policy running now


class InlineRequest(BaseModel):
    arrival: float = Field(ge=0, le=MAX_DURATION_S)
    prompt_len: int = Field(ge=1, le=1_000_000)
    output_len: int = Field(ge=1, le=1_000_000)


class SimulateRequest(BaseModel):
    trace: str = Field(SYNTHETIC_BURSTY, pattern=f"^({'|'.join(SIMULATION_TRACES)})$")
    requests: list[InlineRequest] = Field(
        default_factory=list,
        max_length=MAX_REQUESTS,
        description="the trace when 'inline'; compress and token_scale apply",
    )
    policies: list[str] = Field(
        default_factory=lambda: list(DEFAULT_POLICIES),
        min_length=1,
        max_length=4,
        description="ours, hpa or static:N",
    )
    compress: float = Field(4.0, gt=0, le=1000)
    token_scale: float = Field(0.25, gt=0, le=10)
    duration_s: float | None = Field(
        None, gt=0, le=MAX_DURATION_S, description="seconds of the trace kept, before compression"
    )
    seed: int = 0
    ttft_slo_s: float = Field(1.0, gt=0, le=600)
    tpot_slo_s: float = Field(0.1, gt=0, le=60)
    max_replicas: int = Field(12, ge=1, le=64)
    crashes: list[float] = Field(
        default_factory=list,
        max_length=100,
        description="simulated seconds at which the busiest replica crashes",
    )



def run_what_if(body: SimulateRequest, progress: Progress | None = None, *,
                profile_path: str = "", trace_path: str = "") -> dict[str, Any]:
    """The simulation behind the endpoints (also callable without HTTP); ValueError for bad input.
    ``profile_path``: the replica profile the control plane runs on ("": the shipped one); ``trace_path``:
    the file the ``azure`` trace stands for ("": ``$CONTROLPLANE_AZURE_TRACE`` or the shipped one).

    ``progress`` sees the fraction of all policies' runs done and the policy simulated now.
    """
    from controlplane.autoscale.profile import describe, load_profile
    from controlplane.sim.settings import PolicySpec, SimSettings
    from controlplane.sim.simulator import compare
    from controlplane.sim.trace import BurstyConfig, TraceShape, azure_trace, shaped, synthetic_bursty

    specs = [PolicySpec.parse(p) for p in body.policies]
    profile = load_profile(profile_path or None)
    about = describe(profile, profile_path)
    shape = TraceShape.fitted(profile.max_model_len, compress=body.compress, token_scale=body.token_scale,
                              duration_s=body.duration_s)
    if body.trace == SYNTHETIC_BURSTY:
        requests = synthetic_bursty(BurstyConfig(seed=body.seed, duration_s=body.duration_s or 3600.0), shape)
    elif body.trace == AZURE_TRACE:
        requests = azure_trace(trace_path or AZURE_TRACE, shape)
    else:
        requests = shaped([(r.arrival, r.prompt_len, r.output_len) for r in body.requests], shape)
    if not requests:
        raise ValueError("trace: no request to simulate")
    if len(requests) > MAX_REQUESTS or max(r.arrival for r in requests) > MAX_DURATION_S:
        raise ValueError(f"trace: at most {MAX_REQUESTS} requests over {MAX_DURATION_S:g} simulated seconds")
    settings = SimSettings.what_if(ttft_slo_s=body.ttft_slo_s, tpot_slo_s=body.tpot_slo_s,
                                   max_replicas=body.max_replicas, crashes=body.crashes)
    hook = None
    if progress is not None:
        labels = [s.label for s in specs]

        def hook(fraction: float) -> None:
            progress(fraction, labels[min(int(fraction * len(labels)), len(labels) - 1)])

    reports = compare(requests, specs, profile=profile, settings=settings, progress=hook)
    return {
        "trace": body.trace,
        "num_requests": len(requests),
        "profile": profile.source,
        "profile_path": about["path"],
        "profile_fit": about["fit"],
        "slo": {"ttft_s": settings.slo.ttft_s, "tpot_s": settings.slo.tpot_s},
        "policies": [r.to_json() for r in reports],
    }


def run_what_if_process(body: SimulateRequest, progress: Progress | None = None, *,
                        profile_path: str = "", cpu_priority: str = "idle") -> dict[str, Any]:
    """:func:`run_what_if` in a worker process at batch CPU priority (``[simulator] cpu_priority``: idle,
    or low); ValueError for bad input, RuntimeError when the worker died without an answer. Blocks the
    calling thread (not the CPU) until it is done."""
    if cpu_priority not in CPU_PRIORITIES:
        raise ValueError(f"cpu_priority: one of {', '.join(CPU_PRIORITIES)}, got {cpu_priority!r}")
    # the server's own trace file, named here: a worker kept from an earlier run has the environment of then
    trace_path = str(trace_file(AZURE_TRACE)) if body.trace == AZURE_TRACE else ""
    request = {"body": body.model_dump(), "profile_path": profile_path, "trace_path": trace_path,
               "cpu_priority": cpu_priority}

    def forward(message: dict[str, Any]) -> None:
        if progress is not None:
            progress(float(message["fraction"]), str(message["policy"]))

    return run_batch_process(WORKER, request, forward, priority=cpu_priority)


def _serve(request: dict[str, Any], progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    body = SimulateRequest.model_validate(request.get("body"))
    return run_what_if(body, lambda fraction, policy: progress({"fraction": fraction, "policy": policy}),
                       profile_path=str(request.get("profile_path", "")),
                       trace_path=str(request.get("trace_path", "")))


def _idle(request: dict[str, Any] | None) -> bool:
    return request is None or request.get("cpu_priority", "idle") == "idle"


if __name__ == "__main__":
    sys.exit(serve_batch_work(_serve, _idle))
