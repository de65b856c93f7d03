"""A replica's measured capacity: the step-time model the fleet simulator runs on, and how to measure it.

The simulator (``controlplane.sim.simulator``) needs one number per engine step: how long a
continuous-batching step takes for a given batch. :class:`ReplicaProfile` models it as linear in what the step
does::

    t = step_base_s + per_seq_s * decoding sequences + per_prefill_token_s * prefill tokens
        + per_context_token_s * context tokens attended by the decoding sequences

:func:`calibrate` fits the four coefficients by least squares (non-negative) to timings of one real replica
(``python -m controlplane.sim profile``), and measures its start time (spawn to ``/ready``). A profile
measured on the development machine ships with the package (``controlplane/data/replica_profile.json``), so
the simulator runs without a replica.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

DEFAULT_PROFILE = "replica_profile.json"
# token ids below this are the default model's special tokens (see inference.bench.datasets)
FIRST_PROMPT_TOKEN_ID = 16
VOCAB_SIZE = 512
REFERENCE_BATCH = 16  # sequences decoded together when converting token rates to engine time
REFERENCE_CONTEXT = 512  # tokens of context per sequence, likewise


@dataclass(slots=True, frozen=True)
class ProfilePoint:
    """One measured step: what it held and how long it took (median over its repetitions)."""

    num_decode: int
    num_prefill_tokens: int
    context_tokens: int
    seconds: float


@dataclass(slots=True, frozen=True)
class ReplicaProfile:
    step_base_s: float
    per_seq_s: float
    per_prefill_token_s: float
    per_context_token_s: float
    start_s: float  # spawn to ready
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    kv_capacity_tokens: int = 87_376
    max_model_len: int = 2048
    source: str = "hand-written"
    points: tuple[ProfilePoint, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("step_base_s", "per_seq_s", "per_prefill_token_s", "per_context_token_s", "start_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name}: must be >= 0, got {value!r}")
        if self.step_base_s + self.per_seq_s <= 0:
            raise ValueError("step_base_s + per_seq_s: a step must take time")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")

    def step_time(self, *, num_decode: int, num_prefill_tokens: int, context_tokens: int) -> float:
        return (
            self.step_base_s
            + self.per_seq_s * num_decode
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_context_token_s * context_tokens
        )

    def decode_tokens_per_s(self, batch: int, context: int) -> float:
        """Generated tokens/s of one replica decoding ``batch`` sequences of ``context`` tokens each."""
        return batch / self.step_time(num_decode=batch, num_prefill_tokens=0, context_tokens=batch * context)

    def engine_load(
        self,
        *,
        prompt_tokens_per_s: float,
        generated_tokens_per_s: float,
        batch: int = REFERENCE_BATCH,
        context: int = REFERENCE_CONTEXT,
    ) -> float:
        """Seconds of engine time per second that these token rates need, decoding at a reference batch.

        Linear in the load (unlike the measured busy share, which small inefficient batches inflate), so
        ``ceil(current * load / target)`` sizes a fleet the way HPA's formula expects.
        """
        per_decode_token = (
            self.step_time(num_decode=batch, num_prefill_tokens=0, context_tokens=batch * context) / batch
        )
        return prompt_tokens_per_s * self.per_prefill_token_s + generated_tokens_per_s * per_decode_token

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ReplicaProfile:
        points = tuple(ProfilePoint(**p) for p in raw.get("points", ()))
        return cls(**{**raw, "points": points})


def load_profile(path: str | Path | None = None) -> ReplicaProfile:
    """The profile in ``path``, or the one measured on the development machine and shipped with us."""
    if path is None:
        text = resources.files("controlplane.data").joinpath(DEFAULT_PROFILE).read_text()
    else:
        text = Path(path).read_text()
    try:
        return ReplicaProfile.from_json(json.loads(text))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path or DEFAULT_PROFILE}: not a replica profile: {exc}") from exc


def fit(points: Sequence[ProfilePoint], **rest: Any) -> ReplicaProfile:
    """Non-negative least squares of the step-time model to measured points."""
    import numpy as np
    from scipy.optimize import nnls  # type: ignore[import-untyped]

    a = np.array([[1.0, p.num_decode, p.num_prefill_tokens, p.context_tokens] for p in points])
    b = np.array([p.seconds for p in points])
    scale = a.max(axis=0)  # columns differ by 1e4; scaling keeps the solver well conditioned
    scale[scale == 0] = 1.0
    coef, _ = nnls(a / scale, b)
    coef = coef / scale
    return ReplicaProfile(
        step_base_s=float(coef[0]),
        per_seq_s=float(coef[1]),
        per_prefill_token_s=float(coef[2]),
        per_context_token_s=float(coef[3]),
        points=tuple(points),
        **rest,
    )


# ---- calibration against a real replica ------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class CalibrationPlan:
    prefill_lens: tuple[int, ...] = (64, 256, 512, 1000)
    decode_batches: tuple[int, ...] = (1, 4, 16, 48)
    decode_contexts: tuple[int, ...] = (128, 1024)
    decode_tokens: int = 24
    repeats: int = 2
    num_threads: int = 1  # as the control plane starts replicas on a shared 2-core machine


def calibrate(
    plan: CalibrationPlan = CalibrationPlan(), *, progress: Callable[[str], None] | None = None
) -> ReplicaProfile:
    """Start one real replica, time its start, prefill and decode steps, and fit the profile."""
    from inference.launcher import ReplicaProcess, free_port
    from inference.models.default import ensure_default_model

    say = progress or (lambda _: None)
    ensure_default_model()  # built once per state folder; not part of a replica's start time
    replica = ReplicaProcess(
        free_port(), replica_id="profile-0", extra_args=["--num-threads", str(plan.num_threads)]
    )
    started = time.monotonic()
    with replica:
        replica.wait_ready(timeout=180)
        start_s = time.monotonic() - started
        say(f"replica ready after {start_s:.2f}s")
        points, limits = asyncio.run(_measure(replica.base_url, plan, say))
    import platform

    source = (
        f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()} "
        f"({platform.processor() or platform.machine()}), default model, {plan.num_threads} torch thread(s)"
    )
    return fit(points, start_s=round(start_s, 3), source=source, **limits)


async def _measure(
    url: str, plan: CalibrationPlan, say: Callable[[str], None]
) -> tuple[list[ProfilePoint], dict[str, int]]:
    points: list[ProfilePoint] = []
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as client:
        limits = await _limits(client)
        await _stream(client, _prompt(rng, 32), 4)  # warm-up: first requests pay for lazy setup
        for length in plan.prefill_lens:
            ttfts = [(await _stream(client, _prompt(rng, length), 1))[0] for _ in range(plan.repeats + 1)]
            points.append(ProfilePoint(0, length, 0, round(min(ttfts), 6)))
            say(f"prefill {length} tokens: {min(ttfts) * 1e3:.1f} ms")
        for context in plan.decode_contexts:
            for batch in plan.decode_batches:
                itls = []
                for _ in range(plan.repeats):
                    runs = await asyncio.gather(
                        *(_stream(client, _prompt(rng, context), plan.decode_tokens) for _ in range(batch))
                    )
                    itls.extend(_steady_gaps(runs))
                seconds = statistics.median(itls)
                ctx = batch * (context + plan.decode_tokens // 2)
                points.append(ProfilePoint(batch, 0, ctx, round(seconds, 6)))
                say(f"decode batch {batch} at context {context}: {seconds * 1e3:.1f} ms/step")
    return points, limits


async def _limits(client: httpx.AsyncClient) -> dict[str, int]:
    """KV capacity from the replica's ``vllm:cache_config_info``; other limits are the engine defaults."""
    from inference.config import EngineConfig

    defaults = EngineConfig()
    limits = {
        "max_num_seqs": defaults.max_num_seqs,
        "max_num_batched_tokens": defaults.max_num_batched_tokens,
    }
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(
                part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            blocks = int(labels["num_gpu_blocks"].strip('"'))
            limits["kv_capacity_tokens"] = blocks * int(labels["block_size"].strip('"'))
    return limits


def _prompt(rng: random.Random, length: int) -> list[int]:
    # fresh random ids each time: a repeated prompt would hit the prefix cache and skip its prefill
    return [rng.randrange(FIRST_PROMPT_TOKEN_ID, VOCAB_SIZE) for _ in range(length)]


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> list[float]:
    """Token arrival times of one streamed completion, relative to when it was sent (first = TTFT)."""
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    sent, times = time.monotonic(), []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(
                f"profile request failed: HTTP {resp.status_code} {(await resp.aread())[:200]!r}"
            )
        async for line in resp.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else "[DONE]"
            if data != "[DONE]" and json.loads(data).get("choices"):
                times.append(time.monotonic() - sent)
    return times


def _steady_gaps(runs: Sequence[list[float]]) -> list[float]:
    """Gaps between tokens once every stream of a batch has its first token (the batch is full)."""
    full_from = max(r[0] for r in runs if r)
    return [b - a for r in runs for a, b in itertools.pairwise(r) if a >= full_from]
