"""Workloads for the load client: what each request asks for, and when it arrives.

The first stage of ``python -m inference.bench serve``: a dataset (``random`` or ``trace:FILE``) becomes a
list of ``BenchRequest`` (prompt length, output length, arrival offset), which ``load_client.py`` sends and
``report.py`` scores. Pure bookkeeping: no network, no clock; everything is seeded.

Prompts are not stored: a trace replayed at full scale asks for tens of millions of prompt tokens, so
``render_prompt`` rebuilds each prompt from (seed, index) when it is sent. The same seed always yields the
same prompts, lengths and arrival schedule.

One trace ships with the package, in ``data/`` (its README gives the source and the CC BY 4.0 license):
one hour of Azure's LLM conversation service. Wherever a trace file is asked for, the name ``azure`` means
it (:func:`trace_file`), in this load client and in the layers above that replay or simulate traces.
"""

from __future__ import annotations

import csv
import importlib.resources
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

PromptFormat = Literal["token_ids", "text"]

TRACE_PREFIX = "trace:"
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
AZURE_TRACE = "azure"  # the name of the shipped trace, wherever a trace file is asked for
AZURE_TRACE_FILE = "azure_llm_conv_2023.csv"
AZURE_TRACE_ENV = "CONTROLPLANE_AZURE_TRACE"  # a trace file that ``azure`` means instead of the shipped one
# Token ids below this are left out of random prompts: small models keep their special tokens there
# (the bundled default model uses 0..3), and a stray EOS or BOS in a prompt changes what is measured.
FIRST_PROMPT_TOKEN_ID = 16
DEFAULT_VOCAB_SIZE = 512  # the bundled default model's vocabulary; larger vocabularies accept these ids too
DEFAULT_INPUT_LEN = 256
DEFAULT_OUTPUT_LEN = 64
# Common one-token English words, so that a chat prompt of N words is about N tokens for most tokenizers.
PROMPT_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from",
    "his", "her", "it", "an", "are", "were", "which", "be", "this", "has", "had", "not", "but", "they",
    "one", "their", "all", "also", "been", "more", "first", "new", "other", "two", "time", "may", "after",
    "only", "into", "some", "would", "than", "many", "over", "most", "such", "used", "when", "year",
    "while", "where", "these", "them", "then", "who", "there", "between", "both", "during", "each", "under",
    "well", "back", "city", "state", "world", "life", "part", "high", "long", "school", "family", "group",
    "number", "water", "house", "place", "point", "name", "music", "game", "south", "north", "west", "east",
    "small", "large", "great", "early", "local", "day",
)


@dataclass(slots=True)
class DatasetConfig:
    """Where requests come from. ``name`` is ``random`` or ``trace:PATH`` (Azure LLM trace CSV)."""

    name: str = "random"
    num_requests: int | None = None  # required for random; a cap for traces
    seed: int = 0
    # random
    input_len: int = DEFAULT_INPUT_LEN
    output_len: int = DEFAULT_OUTPUT_LEN
    range_ratio: float = 0.0  # lengths drawn uniformly from len * [1 - r, 1 + r]
    vocab_size: int = DEFAULT_VOCAB_SIZE  # token ids are drawn from [FIRST_PROMPT_TOKEN_ID, vocab_size)
    # trace
    time_scale: float = 1.0  # 10: replay ten times faster
    token_scale: float = 1.0  # multiplies both lengths; at least one token survives
    max_input_len: int | None = None
    max_output_len: int | None = None
    trace_start: float = 0.0  # seconds into the trace
    trace_duration: float | None = None  # seconds of the trace to keep (before time scaling)

    def __post_init__(self) -> None:
        if not self.is_trace and self.name != "random":
            raise ValueError(f"dataset: must be 'random' or 'trace:FILE', got {self.name!r}")
        if self.is_trace and not self.trace_path.name:
            raise ValueError(f"dataset: 'trace:' needs a file or {AZURE_TRACE!r}, as in trace:{AZURE_TRACE}")
        if not self.is_trace and self.num_requests is None:
            raise ValueError("num_requests: required for the random dataset")
        _check(self.num_requests is None or self.num_requests >= 1, "num_requests", self.num_requests, ">= 1")
        _check(self.input_len >= 1, "input_len", self.input_len, ">= 1")
        _check(self.output_len >= 1, "output_len", self.output_len, ">= 1")
        _check(0.0 <= self.range_ratio < 1.0, "range_ratio", self.range_ratio, "in [0, 1)")
        _check(self.vocab_size > FIRST_PROMPT_TOKEN_ID, "vocab_size", self.vocab_size,
               f"> {FIRST_PROMPT_TOKEN_ID}")
        _check(self.time_scale > 0 and math.isfinite(self.time_scale), "time_scale", self.time_scale, "> 0")
        _check(self.token_scale > 0 and math.isfinite(self.token_scale), "token_scale", self.token_scale,
               "> 0")
        _check(self.max_input_len is None or self.max_input_len >= 1, "max_input_len", self.max_input_len,
               ">= 1")
        _check(self.max_output_len is None or self.max_output_len >= 1, "max_output_len",
               self.max_output_len, ">= 1")
        _check(self.trace_start >= 0, "trace_start", self.trace_start, ">= 0")
        _check(self.trace_duration is None or self.trace_duration > 0, "trace_duration", self.trace_duration,
               "> 0")

    @property
    def is_trace(self) -> bool:
        return self.name.startswith(TRACE_PREFIX)

    @property
    def trace_path(self) -> Path:
        return trace_file(self.name.removeprefix(TRACE_PREFIX))


def shipped_trace() -> Path:
    """The Azure LLM conversation trace (2023) that ships with this package, as a file."""
    trace = importlib.resources.files(__package__ or "inference.bench") / "data" / AZURE_TRACE_FILE
    if not isinstance(trace, Path):  # installed zipped: the trace readers want a file on disk
        raise FileNotFoundError(f"{AZURE_TRACE_FILE}: the package is not installed as files ({trace})")
    return trace


def trace_file(name: str, environ: Mapping[str, str] | None = None) -> Path:
    """The file a trace name stands for: ``azure`` is ``$CONTROLPLANE_AZURE_TRACE`` when set, else the
    shipped trace; anything else is a path."""
    if name != AZURE_TRACE:
        return Path(name).expanduser()
    override = (os.environ if environ is None else environ).get(AZURE_TRACE_ENV, "").strip()
    return Path(override).expanduser() if override else shipped_trace()


@dataclass(slots=True, frozen=True)
class BenchRequest:
    """One request of a workload. ``arrival`` is seconds after the run's start (None: as soon as possible)."""

    index: int
    prompt_len: int
    output_len: int
    arrival: float | None = None


@dataclass(slots=True, frozen=True)
class TraceRow:
    """One row of an Azure LLM inference trace: arrival offset (s from the first row) and token counts."""

    offset: float
    context_tokens: int
    generated_tokens: int


def build_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """The workload of ``cfg``: random lengths without arrivals, or a trace window with its arrivals."""
    if cfg.is_trace:
        return trace_requests(read_trace(cfg.trace_path), cfg)
    return random_requests(cfg)


def random_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """``num_requests`` requests with lengths uniform in ``len * [1 - range_ratio, 1 + range_ratio]``."""
    assert cfg.num_requests is not None  # DatasetConfig requires it for random
    rng = random.Random(f"lengths:{cfg.seed}")
    return [BenchRequest(index=i, prompt_len=_spread(rng, cfg.input_len, cfg.range_ratio),
                         output_len=_spread(rng, cfg.output_len, cfg.range_ratio))
            for i in range(cfg.num_requests)]


def _spread(rng: random.Random, length: int, ratio: float) -> int:
    low = max(1, math.floor(length * (1.0 - ratio)))
    high = max(low, math.ceil(length * (1.0 + ratio)))
    return rng.randint(low, high)


def read_trace(path: Path) -> list[TraceRow]:
    """Rows of an Azure trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), offsets from the first row."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: not an Azure LLM trace, missing columns {missing}")
        parsed = [(*_parse_timestamp(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                  for r in reader]
    if not parsed:
        raise ValueError(f"{path}: the trace has no rows")
    first, first_fraction = parsed[0][0], parsed[0][1]
    return [TraceRow(offset=(t - first).total_seconds() + (fraction - first_fraction), context_tokens=c,
                     generated_tokens=g) for t, fraction, c, g in parsed]


def _parse_timestamp(text: str) -> tuple[datetime, float]:
    """``2023-11-16 18:15:46.6805900`` -> (whole seconds, fraction).

    Kept apart because datetime holds six fraction digits and POSIX floats lose the seventh; offsets
    are differences of datetimes (no time zone involved) plus differences of fractions.
    """
    whole, _, fraction = text.strip().partition(".")
    return datetime.fromisoformat(whole), float(f"0.{fraction}") if fraction else 0.0


def trace_requests(rows: list[TraceRow], cfg: DatasetConfig) -> list[BenchRequest]:
    """Cut the window ``[trace_start, trace_start + trace_duration)``, then scale time and tokens."""
    end = math.inf if cfg.trace_duration is None else cfg.trace_start + cfg.trace_duration
    window = [r for r in rows if cfg.trace_start <= r.offset < end]
    if cfg.num_requests is not None:
        window = window[:cfg.num_requests]
    return [BenchRequest(index=i, arrival=(r.offset - cfg.trace_start) / cfg.time_scale,
                         prompt_len=_scale_tokens(r.context_tokens, cfg.token_scale, cfg.max_input_len),
                         output_len=_scale_tokens(r.generated_tokens, cfg.token_scale, cfg.max_output_len))
            for i, r in enumerate(window)]


def _scale_tokens(count: int, scale: float, clamp: int | None) -> int:
    scaled = max(1, round(count * scale))
    return scaled if clamp is None else min(scaled, clamp)


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets of a Poisson process of ``rate`` requests/s; the first request arrives at 0.

    ``rate`` of ``inf`` sends everything at once. The generator is seeded apart from the length
    generator: with one shared stream, long gaps would line up with long requests.
    """
    if not rate > 0:
        raise ValueError(f"request_rate: must be > 0, got {rate!r}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals:{seed}")
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def with_arrivals(requests: Sequence[BenchRequest], arrivals: Sequence[float | None]) -> list[BenchRequest]:
    return [BenchRequest(index=r.index, prompt_len=r.prompt_len, output_len=r.output_len, arrival=a)
            for r, a in zip(requests, arrivals, strict=True)]


def render_prompt(request: BenchRequest, fmt: PromptFormat, *, seed: int, vocab_size: int) -> list[int] | str:
    """The prompt of ``request``: random token ids (``/v1/completions``) or random words (chat).

    Rebuilt from (seed, index) on every call, so it costs no memory until the request is sent.
    """
    rng = random.Random(f"prompt:{seed}:{request.index}")
    if fmt == "token_ids":
        return rng.choices(range(FIRST_PROMPT_TOKEN_ID, vocab_size), k=request.prompt_len)
    return " ".join(rng.choices(PROMPT_WORDS, k=request.prompt_len))


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}: must be {rule}, got {value!r}")
