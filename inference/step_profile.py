"""Where an engine step's time goes: a wall-clock breakdown by phase, recorded only while profiling.

The step's code marks the end of each phase with ``lap(name)``: the time since the previous mark is
charged to ``name``, so the phases of a step add up to its whole wall time, Python overhead included
(each phase carries the interpreter's work between its kernels). Attention marks its own phases from
inside the model; whatever runs between two attention layers (norms, projections, rotary, the MLP) is
charged to ``model: rest``.

Off (the default), ``current()`` is None and each mark costs one global read. On an accelerator each mark
synchronizes the device first, so that a phase holds its kernels' time rather than their launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

SCHEDULE = "schedule"
PREPARE = "prepare inputs"
CACHE_WRITE = "attention: cache write"
GATHER = "attention: gather K/V"
ATTEND = "attention: compute"
MODEL_REST = "model: rest"
DECODE_LAYERS = "decoder layers in C++ (attention included)"
LOGITS = "logits"
SAMPLING = "sampling"
POSTPROCESS = "postprocess + detokenize"
PHASES = (SCHEDULE, PREPARE, CACHE_WRITE, GATHER, ATTEND, DECODE_LAYERS, MODEL_REST, LOGITS, SAMPLING,
          POSTPROCESS)


@dataclass(slots=True)
class StepRecord:
    num_prefill_tokens: int
    num_decode_tokens: int
    seconds: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass(slots=True)
class StepProfile:
    """The steps recorded while profiling, each with its phases' seconds."""

    synchronize: Callable[[], None] = lambda: None
    clock: Callable[[], float] = time.perf_counter
    steps: list[StepRecord] = field(default_factory=list)
    _last: float = 0.0
    _open: dict[str, float] | None = None

    def begin(self) -> None:
        self.synchronize()
        self._open = dict.fromkeys(PHASES, 0.0)
        self._last = self.clock()

    def lap(self, phase: str) -> None:
        if self._open is None:
            return
        self.synchronize()
        now = self.clock()
        self._open[phase] += now - self._last
        self._last = now

    def end(self, num_prefill_tokens: int, num_decode_tokens: int) -> None:
        if self._open is not None:
            self.steps.append(StepRecord(num_prefill_tokens, num_decode_tokens, self._open))
        self._open = None

    def decode_breakdown(self, min_batch: int = 1) -> Breakdown | None:
        """Mean seconds per phase over the pure-decode steps of at least ``min_batch`` sequences."""
        chosen = [s for s in self.steps if s.num_prefill_tokens == 0 and s.num_decode_tokens >= min_batch]
        if not chosen:
            return None
        n = len(chosen)
        return Breakdown(n, sum(s.num_decode_tokens for s in chosen) / n,
                         {p: sum(s.seconds[p] for s in chosen) / n for p in PHASES})


@dataclass(slots=True, frozen=True)
class Breakdown:
    num_steps: int
    mean_batch: float
    seconds: dict[str, float]  # mean per step, by phase

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    def to_dict(self) -> dict[str, object]:
        return {"num_steps": self.num_steps, "mean_batch": self.mean_batch,
                "step_ms": self.step_seconds * 1e3, "phase_ms": {p: s * 1e3 for p, s in self.seconds.items()}}


_current: StepProfile | None = None


def current() -> StepProfile | None:
    return _current


def lap(phase: str) -> None:
    """End ``phase`` now, when a profile is being recorded."""
    if _current is not None:
        _current.lap(phase)


@contextmanager
def profiling(profile: StepProfile) -> Iterator[StepProfile]:
    """Record every engine step run in this block into ``profile``."""
    global _current
    previous, _current = _current, profile
    try:
        yield profile
    finally:
        _current = previous


@contextmanager
def paused() -> Iterator[None]:
    """No profile records inside this block (a CUDA graph's capture: a lap would synchronize in it)."""
    global _current
    previous, _current = _current, None
    try:
        yield
    finally:
        _current = previous
