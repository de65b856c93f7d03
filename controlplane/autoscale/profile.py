"""A replica's measured capacity: the step-time model the fleet simulator and the autoscaler run on.

The simulator (``controlplane.sim.simulator``) needs one number per engine step: how long a
continuous-batching step takes for a given batch. :class:`ReplicaProfile` models it in the terms the engine
spends its time on::

    t = step_base_s                                        fixed cost of a step (scheduling, sampling setup)
        + per_seq_s * decoding sequences                   the matrices' work per decoded token
        + per_prefill_token_s * prefill tokens             the same work per prompt token
        + per_context_token_s * context tokens             decode attention: each decoder reads its context
        + per_prefill_pair_s * prefill attention pairs     prefill attention: each prompt token attends
                                                           to every token before it (a chunk of c tokens
                                                           after p prefilled ones: c * p + c * (c + 1) / 2)

so prefill is super-linear in the prompt's length and a decode step grows with the context it attends. The
coefficients are fitted (non-negative least squares on relative error, so short steps weigh as much as long
ones) to timings of one real replica by ``controlplane calibrate`` (:mod:`controlplane.autoscale.calibrate`),
which also times points it does not fit on and keeps both errors in the profile (:class:`FitError`). A
profile measured on the development machine ships with the package
(``controlplane/data/replica_profile.json``), so the simulator runs without a replica; a profile calibrated
on the host (``<state_dir>/replica_profile.json``) takes its place (:func:`resolve_profile_path`).

The policy benchmarks (``python -m controlplane.sim bench``) run on another shipped profile, the
*reference* (``controlplane/data/reference_profile.json``, :func:`load_reference_profile`): the replica
their traffic was sized for, kept fixed so that a faster engine does not move every policy figure. The
shipped fallback follows the replica the fleet runs by default; the reference, a replica without the CPU
decode kernel, is also the fallback of a fleet configured to run without it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_PROFILE = "replica_profile.json"
REFERENCE_PROFILE = "reference_profile.json"  # the policy benchmarks' replica (see the module's docstring)
CALIBRATED_PROFILE = "replica_profile.json"  # in the control plane's state folder, written by calibrate
REFERENCE_BATCH = 16  # sequences decoded together when converting token rates to engine time
REFERENCE_CONTEXT = 512  # tokens of context per sequence, likewise
REFERENCE_PROMPT = 1024  # prompt tokens, when the mean prompt is unknown
HELD_OUT_BOUND = 0.15  # the largest relative error on held-out points a calibration may keep


def attention_pairs(chunk: int, before: int = 0) -> int:
    """(query, key) pairs a prefill chunk of ``chunk`` tokens attends, after ``before`` prefilled tokens."""
    return chunk * before + chunk * (chunk + 1) // 2


@dataclass(slots=True, frozen=True)
class ProfilePoint:
    """One measured step: what it held and how long it took (median or best over its repetitions)."""

    num_decode: int
    num_prefill_tokens: int
    context_tokens: int
    seconds: float
    prefill_pairs: int = -1  # -1: one chunk from the prompt's start (attention_pairs)

    def __post_init__(self) -> None:
        if self.prefill_pairs < 0:
            object.__setattr__(self, "prefill_pairs", attention_pairs(self.num_prefill_tokens))
        if not self.seconds > 0:
            raise ValueError(f"seconds: must be > 0, got {self.seconds!r}")


@dataclass(slots=True, frozen=True)
class FitError:
    """Relative errors of a fit, ``|predicted - measured| / measured``, on the points it was fitted to
    and on held-out points it never saw (the figure that bounds what the simulator may claim)."""

    calibration_max: float
    calibration_mean: float
    held_out_max: float | None  # None: no held-out point
    held_out_mean: float | None

    @property
    def over_bound(self) -> bool:
        """Held-out error over :data:`HELD_OUT_BOUND`: ``controlplane calibrate`` would not install it."""
        return self.held_out_max is not None and self.held_out_max > HELD_OUT_BOUND

    def describe(self) -> str:
        fitted = f"{self.calibration_max:.1%} max, {self.calibration_mean:.1%} mean on calibration points"
        if self.held_out_max is None:
            return f"{fitted}; no held-out point"
        return f"{fitted}; {self.held_out_max:.1%} max, {self.held_out_mean:.1%} mean held out"


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
    per_prefill_pair_s: float = 0.0
    held_out: tuple[ProfilePoint, ...] = field(default_factory=tuple)
    # the CPU limit (cores) the replica was measured under (``controlplane calibrate --cpu-limit``); None:
    # none, the replica had whatever the host gave it. The simulator counts a busy replica as this much of
    # a core when replicas share the host's cores.
    cpu_limit: float | None = None
    # spawn to ready while another replica serves a steady decode load on the same host (``controlplane
    # calibrate``): what a scale-up gets, since the fleet grows when its replicas are busy. None: not
    # measured (profiles before 2026-12-07, hand-written ones); ``start_s`` stands for it.
    busy_start_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("step_base_s", "per_seq_s", "per_prefill_token_s", "per_context_token_s", "start_s",
                     "per_prefill_pair_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name}: must be >= 0, got {value!r}")
        if self.step_base_s + self.per_seq_s <= 0:
            raise ValueError("step_base_s + per_seq_s: a step must take time")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")
        if self.cpu_limit is not None and not self.cpu_limit > 0:
            raise ValueError(f"cpu_limit: must be > 0 or null, got {self.cpu_limit!r}")
        if self.busy_start_s is not None and not self.busy_start_s >= 0:
            raise ValueError(f"busy_start_s: must be >= 0 or null, got {self.busy_start_s!r}")

    @property
    def scale_up_start_s(self) -> float:
        """Spawn to ready of a replica added beside busy ones: measured so when calibrated, else the start
        alone."""
        return self.start_s if self.busy_start_s is None else self.busy_start_s

    def step_time(self, *, num_decode: int, num_prefill_tokens: int, context_tokens: int,
                  prefill_pairs: int | None = None) -> float:
        """Seconds of one step; ``prefill_pairs`` defaults to one chunk from the prompt's start."""
        pairs = attention_pairs(num_prefill_tokens) if prefill_pairs is None else prefill_pairs
        return self.seconds(steps=1, num_decode=num_decode, num_prefill_tokens=num_prefill_tokens,
                            context_tokens=context_tokens, prefill_pairs=pairs)

    def seconds(self, *, steps: float, num_decode: float, num_prefill_tokens: float, context_tokens: float,
                prefill_pairs: float) -> float:
        """Seconds of ``steps`` steps whose terms sum to the others: the model is linear, so a run of steps
        is priced from its sums (:mod:`controlplane.autoscale.drift`)."""
        return (
            self.step_base_s * steps
            + self.per_seq_s * num_decode
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_context_token_s * context_tokens
            + self.per_prefill_pair_s * prefill_pairs
        )

    def predict(self, point: ProfilePoint) -> float:
        return self.step_time(num_decode=point.num_decode, num_prefill_tokens=point.num_prefill_tokens,
                              context_tokens=point.context_tokens, prefill_pairs=point.prefill_pairs)

    def fit_error(self) -> FitError:
        fitted = [self.relative_error(p) for p in self.points] or [0.0]
        held = [self.relative_error(p) for p in self.held_out]
        return FitError(max(fitted), sum(fitted) / len(fitted), max(held) if held else None,
                        sum(held) / len(held) if held else None)

    def relative_error(self, point: ProfilePoint) -> float:
        return abs(self.predict(point) - point.seconds) / point.seconds

    def prefill_s_per_token(self, prompt_tokens: float) -> float:
        """Engine seconds per prompt token, for prompts of this length prefilled in chunks of at most
        ``max_num_batched_tokens`` (each token attends to half the prompt on average)."""
        return self.per_prefill_token_s + self.per_prefill_pair_s * (max(prompt_tokens, 1.0) + 1) / 2

    def decode_s_per_token(self, batch: int = REFERENCE_BATCH, context: int = REFERENCE_CONTEXT) -> float:
        """Engine seconds per generated token decoding ``batch`` sequences of ``context`` tokens each."""
        step = self.step_time(num_decode=batch, num_prefill_tokens=0, context_tokens=batch * context)
        return step / batch

    def decode_tokens_per_s(self, batch: int, context: int) -> float:
        """Generated tokens/s of one replica decoding ``batch`` sequences of ``context`` tokens each."""
        return 1.0 / self.decode_s_per_token(batch, context)

    def engine_load(self, *, prompt_tokens_per_s: float, generated_tokens_per_s: float,
                    mean_prompt_tokens: float = REFERENCE_PROMPT, batch: int = REFERENCE_BATCH,
                    context: int = REFERENCE_CONTEXT) -> float:
        """Seconds of engine time per second that these token rates need, decoding at a reference batch.

        Linear in the load (unlike the measured busy share, which small inefficient batches inflate), so
        ``ceil(current * load / target)`` sizes a fleet the way HPA's formula expects.
        """
        return (prompt_tokens_per_s * self.prefill_s_per_token(mean_prompt_tokens)
                + generated_tokens_per_s * self.decode_s_per_token(batch, context))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ReplicaProfile:
        points = tuple(ProfilePoint(**p) for p in raw.get("points", ()))
        held_out = tuple(ProfilePoint(**p) for p in raw.get("held_out", ()))
        return cls(**{**raw, "points": points, "held_out": held_out})


def load_profile(path: str | Path | None = None) -> ReplicaProfile:
    """The profile in ``path``, or the one measured on the development machine and shipped with us."""
    if path is None:
        return _packaged(DEFAULT_PROFILE)
    return _parsed(Path(path).read_text(), str(path))


def load_reference_profile() -> ReplicaProfile:
    """The replica the policy benchmarks' traffic is sized for (a real calibration, kept fixed)."""
    return _packaged(REFERENCE_PROFILE)


def _packaged(name: str) -> ReplicaProfile:
    return _parsed(resources.files("controlplane.data").joinpath(name).read_text(), name)


def _parsed(text: str, where: str) -> ReplicaProfile:
    try:
        return ReplicaProfile.from_json(json.loads(text))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a replica profile: {exc}") from exc


def resolve_profile_path(configured: str, state_dir: str | Path, *,
                         cpu_decode_kernel: bool | None = None, packed_weights: bool | None = None) -> str:
    """Which profile the control plane runs on: the configured file, else the one ``controlplane calibrate``
    wrote for this host into the state folder, else "" (the shipped one, a default replica's: the CPU
    decode kernel and packed weights) or, for a fleet whose replicas run without the CPU decode kernel or
    without packed weights (``[fleet] cpu_decode_kernel = false``, ``packed_weights = false``), the shipped
    reference, which is the torch path's: the default replica's profile would size that fleet for replicas
    1.2-2x faster than it runs, too few of them (the reference errs the other way, too many)."""
    if configured:
        return configured
    calibrated = Path(state_dir) / CALIBRATED_PROFILE
    if calibrated.is_file():
        return str(calibrated)
    if cpu_decode_kernel is False or packed_weights is False:
        return str(resources.files("controlplane.data").joinpath(REFERENCE_PROFILE))
    return ""


def describe(profile: ReplicaProfile, path: str = "") -> dict[str, Any]:
    """What a result says about the profile it came from: where, how it was measured, how well it fits."""
    error = profile.fit_error()
    return {"path": path or "shipped", "source": profile.source, "fit_error": asdict(error),
            "fit": error.describe()}


def fit(points: Sequence[ProfilePoint], held_out: Sequence[ProfilePoint] = (), **rest: Any) -> ReplicaProfile:
    """Non-negative least squares of the step-time model to measured points, on relative error."""
    import numpy as np
    from scipy.optimize import nnls  # type: ignore[import-untyped]

    a = np.array([[1.0, p.num_decode, p.num_prefill_tokens, p.context_tokens, p.prefill_pairs]
                  for p in points])
    b = np.array([p.seconds for p in points])
    a, b = a / b[:, None], np.ones_like(b)  # each row over its own time: relative error
    scale = a.max(axis=0)  # columns differ by 1e6; scaling keeps the solver well conditioned
    scale[scale == 0] = 1.0
    coef, _ = nnls(a / scale, b)
    coef = coef / scale
    return ReplicaProfile(
        step_base_s=float(coef[0]),
        per_seq_s=float(coef[1]),
        per_prefill_token_s=float(coef[2]),
        per_context_token_s=float(coef[3]),
        per_prefill_pair_s=float(coef[4]),
        points=tuple(points),
        held_out=tuple(held_out),
        **rest,
    )


def refit(profile: ReplicaProfile) -> ReplicaProfile:
    """The profile fitted again to its own calibration points (what a shipped profile must reproduce)."""
    rest = {k: v for k, v in asdict(profile).items()
            if k not in {"step_base_s", "per_seq_s", "per_prefill_token_s", "per_context_token_s",
                         "per_prefill_pair_s", "points", "held_out"}}
    return replace(fit(profile.points, profile.held_out, **rest), source=profile.source)
