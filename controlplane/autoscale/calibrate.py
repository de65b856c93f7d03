"""``controlplane calibrate``'s measurement: one real replica of the default model, timed step by step.

It starts a replica as the control plane does (its own process, ``num_threads`` torch threads), times its
start (spawn to ``/ready``), prefills of several lengths (time to first token of a one-token completion;
each prompt is fresh random ids, so the prefix cache never skips the work) and decode steps of several
batch sizes at several context lengths (the median gap between tokens while every stream of the batch
decodes), in rounds over all points, each point keeping its median round; times a second replica's
start while the first serves a steady decode load (a scale-up's start: the fleet grows when its replicas
are busy); reads its KV capacity from ``vllm:cache_config_info``; fits
:class:`~controlplane.autoscale.profile.ReplicaProfile` to the calibration points and reports its error
on held-out points measured the same way but never fitted.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from controlplane.autoscale.profile import ProfilePoint, ReplicaProfile, fit
from controlplane.errors import Unavailable
from inference.config import switch_args
from inference.environment import child_environment
from inference.forkserver import ForkServer, ForkServerError
from inference.metrics import ENGINE_INFO

# token ids below this are the default model's special tokens (see inference.bench.datasets)
FIRST_PROMPT_TOKEN_ID = 16
VOCAB_SIZE = 512
DECODE_TRIES = 3  # of a decode repetition whose batch never ran whole
KERNEL_BUILD_TIMEOUT_S = 600.0  # a first build of the CPU decode kernel takes 20-40 s on 2 cores

Progress = Callable[[int, int, str], None]  # (measurements done, in all, what was just measured)


@dataclass(slots=True, frozen=True)
class Decode:
    batch: int
    context: int


# The load the first replica serves while a second starts: a full steady batch, each stream longer than any
# start takes (1,500 steps of 10-30 ms), cut once the second replica is ready.
BUSY_LOAD = Decode(16, 256)
BUSY_TOKENS = 1500
BUSY_RAMP_S = 1.0  # the load's prefills (16 of 256 tokens, about 0.6 s) before the second replica starts


@dataclass(slots=True, frozen=True)
class CalibrationPlan:
    prefill_lens: tuple[int, ...] = (64, 256, 512, 1024)
    decodes: tuple[Decode, ...] = tuple(Decode(b, c) for c in (128, 1024) for b in (1, 4, 16, 48))
    held_out_prefill_lens: tuple[int, ...] = (128, 384, 768)
    held_out_decodes: tuple[Decode, ...] = (Decode(8, 512), Decode(32, 256), Decode(24, 768))
    decode_tokens: int = 16  # steady steps timed per stream, once the whole batch decodes
    repeats: int = 3  # rounds over every point; each keeps its median round (decode: of its median steps)
    num_threads: int = 1  # as the control plane starts replicas on a shared 2-core machine
    cpu_decode_kernel: bool | None = None  # the replica's C++ decode kernel ([fleet] cpu_decode_kernel)
    packed_weights: bool | None = None  # the replica's packed linear weights ([fleet] packed_weights)
    cpu_limit: float | None = None  # the replica's CPU limit in cores ([fleet] replica_cpu_limit)
    busy_starts: int = 3  # starts of a second replica beside the busy first; the profile keeps the median
    fork: bool = True  # replicas forked from a fork server, as the fleet starts them ([fleet] fork_replicas)

    def __post_init__(self) -> None:
        if len(self.prefill_lens) + len(self.decodes) < 5:
            raise ValueError("a calibration needs at least 5 points for the model's 5 coefficients")
        if self.repeats < 1 or self.decode_tokens < 4 or self.num_threads < 1 or self.busy_starts < 0:
            raise ValueError("repeats and num_threads: >= 1; decode_tokens: >= 4; busy_starts: >= 0")
        if self.cpu_limit is not None and not self.cpu_limit > 0:
            raise ValueError(f"cpu_limit: must be > 0 cores, got {self.cpu_limit!r}")

    @property
    def num_points(self) -> int:
        return (len(self.prefill_lens) + len(self.decodes) + len(self.held_out_prefill_lens)
                + len(self.held_out_decodes))

    @property
    def num_measurements(self) -> int:
        return self.num_points * self.repeats + self.busy_starts


QUICK_PLAN = CalibrationPlan(
    prefill_lens=(64, 384, 1024), decodes=(Decode(1, 128), Decode(8, 128), Decode(24, 768)),
    held_out_prefill_lens=(256,), held_out_decodes=(Decode(12, 512),), decode_tokens=16, repeats=2,
    busy_starts=1)


def calibrate(plan: CalibrationPlan = CalibrationPlan(), *,
              progress: Progress | None = None) -> ReplicaProfile:
    """Start one real replica, time its start, prefill and decode steps, and fit the profile."""
    from inference.launcher import ReplicaProcess, free_port
    from inference.models.default import ensure_default_model

    say = progress or (lambda *_: None)
    ensure_default_model()  # built once per state folder; not part of a replica's start time
    if (build := kernel_build_command(plan)) is not None:
        # built once per machine (20-40 s the first time): not part of a replica's start time either; where
        # it cannot build, the command says why and the replica runs the torch path, as in the fleet
        subprocess.run(build, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=child_environment(), timeout=KERNEL_BUILD_TIMEOUT_S)
    server = fork_server(plan, say)
    try:
        replica = ReplicaProcess(free_port(), replica_id="calibrate-0", extra_args=replica_args(plan),
                                 forkserver=server)
        started = time.monotonic()
        with replica:
            replica.wait_ready(timeout=180)  # a replica that could not have its CPU limit exits: said here
            start_s = time.monotonic() - started
            say(0, plan.num_measurements, f"replica ready after {start_s:.2f}s")
            points, held_out, limits = asyncio.run(_measure(replica.base_url, plan, say))
            busy_start_s = busy_start(replica.base_url, plan, say, server) if plan.busy_starts else None
    finally:
        if server is not None:
            server.close()
    kernel, packed = limits.pop("cpu_decode_kernel", 0), limits.pop("packed_weights", 0)
    source = (f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()} "
              f"({platform.processor() or platform.machine()}), default model, {plan.num_threads} torch "
              f"thread(s){', CPU decode kernel' if kernel else ''}{', packed weights' if packed else ''}"
              f"{'' if plan.cpu_limit is None else f', CPU limit {plan.cpu_limit:g} cores'}"
              f"{', forked starts' if server is not None else ''}")
    return fit(points, held_out, start_s=round(start_s, 3), source=source, cpu_limit=plan.cpu_limit,
               busy_start_s=busy_start_s, **limits)


def fork_server(plan: CalibrationPlan, say: Progress) -> ForkServer | None:
    """A fork server with its imports done, where the plan forks replicas (at ``controlplane up`` the fork
    server imports while the control plane starts, so that is no part of a replica's start); None, with the
    reason said, where it cannot run: the fleet then exec's its replicas, and so does the calibration."""
    from inference.launcher import replica_environment

    if not plan.fork:
        return None
    server = None
    try:
        server = ForkServer(replica_environment())
        server.wait_ready()
    except ForkServerError as exc:
        if server is not None:
            server.close()
        say(0, plan.num_measurements, f"replicas exec'd, not forked: {exc}")
        return None
    return server


def busy_start(url: str, plan: CalibrationPlan, say: Progress, server: ForkServer | None = None) -> float:
    """Spawn to ready of a second replica (the fleet's flags) while the replica at ``url`` decodes
    :data:`BUSY_LOAD`: the median of ``plan.busy_starts`` tries. Alone a replica starts on idle cores; at a
    scale-up it shares them with a busy replica and the processes serving its traffic, and starts slower
    (1.5-2.3x the start alone, in the live runs of ``python -m controlplane.bench sim-vs-live``)."""
    done = plan.num_points * plan.repeats
    times = []
    for i in range(plan.busy_starts):
        replica_id = f"calibrate-{i + 1}"
        times.append(asyncio.run(_start_beside_load(url, plan, seed=1000 + i, replica_id=replica_id,
                                                    server=server)))
        say(done + i + 1, plan.num_measurements, f"a replica started beside a busy one in {times[-1]:.2f}s")
    return round(statistics.median(times), 3)


async def _start_beside_load(url: str, plan: CalibrationPlan, *, seed: int, replica_id: str,
                             server: ForkServer | None) -> float:
    from inference.launcher import ReplicaProcess, free_port

    def start() -> float:
        second = ReplicaProcess(free_port(), replica_id=replica_id, extra_args=replica_args(plan),
                                forkserver=server)
        started = time.monotonic()
        with second:
            second.wait_ready(timeout=180)
            return time.monotonic() - started

    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as client:
        load = [asyncio.create_task(_stream(client, _prompt(rng, BUSY_LOAD.context), BUSY_TOKENS))
                for _ in range(BUSY_LOAD.batch)]
        try:
            await asyncio.sleep(BUSY_RAMP_S)
            if any(task.done() for task in load):  # a refused request: its error, not a start time
                await next(task for task in load if task.done())
            return await asyncio.to_thread(start)
        finally:
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)


def kernel_build_command(plan: CalibrationPlan) -> list[str] | None:
    """``python -m inference kernel`` (what ``make up`` runs first), unless the replica runs without the
    kernel; None then."""
    return None if plan.cpu_decode_kernel is False else [sys.executable, "-m", "inference", "kernel"]


def replica_args(plan: CalibrationPlan) -> list[str]:
    """The calibrated replica's flags: the fleet's thread count, engine switches and CPU limit."""
    kernel = switch_args("--cpu-decode-kernel", plan.cpu_decode_kernel)
    packed = switch_args("--packed-weights", plan.packed_weights)
    limit = [] if plan.cpu_limit is None else ["--cpu-limit", f"{plan.cpu_limit:g}"]
    return ["--num-threads", str(plan.num_threads), *kernel, *packed, *limit]


def calibrate_with_bar(plan: CalibrationPlan = CalibrationPlan()) -> ReplicaProfile:
    """:func:`calibrate` with a progress bar on the terminal (``controlplane calibrate``, the benchmarks)."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    with tqdm(total=plan.num_measurements, desc="calibrate", unit="step") as bar:

        def progress(done: int, total: int, what: str) -> None:
            bar.update(done - bar.n)
            bar.set_postfix_str(what)

        return calibrate(plan, progress=progress)


async def _measure(url: str, plan: CalibrationPlan,
                   say: Progress) -> tuple[list[ProfilePoint], list[ProfilePoint], dict[str, int]]:
    """Every point once per round, ``repeats`` rounds: a slow spell of a shared host then costs each point
    at most one of its repetitions, and each point keeps its median round. The median, not the best: the
    profile prices the steps a serving replica takes on this host, typical ones; the best of three read 9%
    under the very replica it was measured on (its busy time over the profile's price of its calibration
    steps, 2026-12-04), the median 1%."""
    rng = random.Random(0)
    steps: list[int | Decode] = [*plan.prefill_lens, *plan.held_out_prefill_lens, *plan.decodes,
                                 *plan.held_out_decodes]
    seconds: dict[int, list[float]] = {i: [] for i in range(len(steps))}
    generated: dict[int, list[int]] = {i: [] for i in range(len(steps))}
    done, total = 0, plan.num_measurements
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as client:
        limits = await _limits(client)
        await _stream(client, _prompt(rng, 32), 4)  # warm-up: first requests pay for lazy setup
        for _ in range(plan.repeats):
            for i, step in enumerate(steps):
                if isinstance(step, Decode):
                    median, tokens = await _decode_once(client, rng, step, plan.decode_tokens,
                                                        limited=plan.cpu_limit is not None)
                    seconds[i].append(median)
                    generated[i].extend(tokens)
                    what = f"decode batch {step.batch} at context {step.context}: {median * 1e3:.1f} ms/step"
                else:
                    seconds[i].append((await _stream(client, _prompt(rng, step), 1))[0])
                    what = f"prefill {step} tokens: {seconds[i][-1] * 1e3:.1f} ms"
                done += 1
                say(done, total, what)
    points = []
    for i, step in enumerate(steps):
        typical = round(statistics.median(seconds[i]), 6)
        if isinstance(step, Decode):
            context = step.batch * (step.context + statistics.fmean(generated[i]))
            points.append(ProfilePoint(step.batch, 0, round(context), typical))
        else:
            points.append(ProfilePoint(0, step, 0, typical))
    n_prefill, n_held = len(plan.prefill_lens), len(plan.held_out_prefill_lens)
    n_decode = len(plan.decodes)
    fitted = points[:n_prefill] + points[n_prefill + n_held:n_prefill + n_held + n_decode]
    held_out = points[n_prefill:n_prefill + n_held] + points[n_prefill + n_held + n_decode:]
    return fitted, held_out, limits


class CalibrationFailed(Unavailable):
    """A measurement could not be taken (the replica refused a request, or a busy host never let a decode
    batch run whole); the same command may succeed when the host is quieter."""


async def _decode_once(client: httpx.AsyncClient, rng: random.Random, d: Decode, steady_tokens: int, *,
                       limited: bool = False) -> tuple[float, list[int]]:
    """One repetition of a decode point: the median step while the whole batch decodes (the mean under a
    CPU limit), and for each of those steps the tokens its sequence had generated. A try in which the batch
    never decoded whole (a host so busy that the first streams finished before the last were admitted) is
    tried again. Under a CPU limit the quota's waits fall on some steps and not others (a 3 ms step runs
    whole in most 10 ms periods and waits at the rest), so the median step reads the unthrottled ones and
    misses the share of time the quota takes; the mean counts it."""
    # Streams are admitted one prefill at a time: the first has ~batch tokens by the time the last has its
    # first. Each asks for enough tokens that all are still decoding for `steady_tokens` steps.
    tokens = d.batch + steady_tokens
    for _ in range(DECODE_TRIES):
        runs = await asyncio.gather(*(_stream(client, _prompt(rng, d.context), tokens)
                                      for _ in range(d.batch)))
        if gaps := _steady_gaps(runs):
            typical = statistics.fmean if limited else statistics.median
            return typical(g for g, _ in gaps), [i for _, i in gaps]
    raise CalibrationFailed(f"decode batch {d.batch} at context {d.context}: no step with the whole batch "
                            f"decoding in {DECODE_TRIES} tries (the replica admitted fewer at once; a busy "
                            "host?)")


async def _limits(client: httpx.AsyncClient) -> dict[str, int]:
    """KV capacity from the replica's ``vllm:cache_config_info``; other limits are the engine defaults.
    ``cpu_decode_kernel``, ``packed_weights``: 1 when the replica's ``llmsre_engine_info`` says its CPU
    decode kernel, or its packed linear weights, are on."""
    from inference.config import EngineConfig

    defaults = EngineConfig()
    limits = {"max_num_seqs": defaults.max_num_seqs,
              "max_num_batched_tokens": defaults.max_num_batched_tokens}
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            inside = line[line.index("{") + 1: line.index("}")]
            labels = dict(part.split("=", 1) for part in inside.split(","))
            blocks = int(labels["num_gpu_blocks"].strip('"'))
            limits["kv_capacity_tokens"] = blocks * int(labels["block_size"].strip('"'))
        elif line.startswith(f"{ENGINE_INFO}{{"):
            limits["cpu_decode_kernel"] = int('cpu_decode_kernel="on"' in line)
            limits["packed_weights"] = int('packed_weights="on"' in line)
    return limits


def _prompt(rng: random.Random, length: int) -> list[int]:
    # fresh random ids each time: a repeated prompt would hit the prefix cache and skip its prefill
    return [rng.randrange(FIRST_PROMPT_TOKEN_ID, VOCAB_SIZE) for _ in range(length)]


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> list[float]:
    """Token arrival times of one streamed completion, relative to when it was sent (first = TTFT)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    sent, times = time.monotonic(), []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise CalibrationFailed(f"calibration request failed: HTTP {resp.status_code} "
                                    f"{(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else "[DONE]"
            if data != "[DONE]" and json.loads(data).get("choices"):
                times.append(time.monotonic() - sent)
    return times


def _steady_gaps(runs: Sequence[list[float]]) -> list[tuple[float, int]]:
    """Gaps between tokens while every stream of a batch is decoding (from the last first token to the
    first last token), each with the number of tokens its stream had generated before it."""
    full_from = max(r[0] for r in runs if r)
    full_until = min(r[-1] for r in runs if r)
    return [(b - a, i + 1) for r in runs for i, (a, b) in enumerate(itertools.pairwise(r))
            if a >= full_from and b <= full_until]
