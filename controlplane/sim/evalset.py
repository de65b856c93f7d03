"""The evaluation set: seven seeded one-hour traffic shapes, kept in the repo, for the policy benchmark.

Where it sits: beside ``controlplane.sim.trace``. Each recipe here generates rows ``(arrival s, prompt
tokens, output tokens)`` at *trace scale*, in the units of the Azure conversation trace (requests/s and
token counts before any shaping), from ``random.Random("evalset:<name>")``: the same recipe always gives
the same rows. The rows are kept as ``controlplane/data/evalset/<name>.csv.gz`` (arrivals rounded to
milliseconds; ``python -m controlplane.sim evalset --write`` regenerates them), and
``python -m controlplane.sim bench --set eval`` runs the policies on the kept files.

Rates are chosen so that, shaped as the benchmark shapes them (no compression, token scale 0.25, prompts
and outputs capped to the default replica's context), the fleet needs about 1 to 10 replicas of the
reference replica (``controlplane/data/reference_profile.json``, the default model on the torch path,
which the benchmark runs on): one shaped request of conversation lengths is about 0.06 of its
engine-seconds. A faster replica (the shipped fallback profile, with the CPU decode kernel: 0.045) needs
fewer, and on it several traces sit at one or two replicas whatever the policy.

The traces, by name (each recipe's function says how and why):

- ``long-prompt`` (:func:`long_prompt`): 4,000-8,000-token prompts, short answers, slowly drifting rate;
- ``code-completion`` (:func:`code_completion`): ~2,000-token prompts, ~20-token outputs, a working-day ramp;
- ``long-output`` (:func:`long_output`): short prompts, reasoning-length outputs, a low steady rate;
- ``bursty`` (:func:`bursty`): the synthetic Markov-modulated trace of ``controlplane.sim.trace``, seed 0;
- ``diurnal`` (:func:`diurnal`): a day compressed into the hour, trough 20% of peak;
- ``flash-crowd`` (:func:`flash_crowd`): a steady low rate with one 2-5 minute step to 8x;
- ``shared-prefix`` (:func:`shared_prefix`): a few long system prompts plus a short unique suffix, the
  only trace whose rows name a shared prefix (two more columns, ``prefix_id`` and ``prefix_tokens``).
"""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import math
import random
import statistics
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

from controlplane.sim.trace import BurstyConfig, RawRow, SimRequest, TraceShape, shaped, synthetic_bursty

Row = RawRow  # arrival seconds, prompt tokens, output tokens[, prefix id, prefix tokens], at trace scale
Rate = Callable[[float], float]  # requests/s at a second of the trace

HOUR_S = 3600.0
DATA_PACKAGE = "controlplane.data"
DATA_FOLDER = "evalset"
HEADER = ("arrival_s", "prompt_tokens", "output_tokens")
PREFIX_HEADER = (*HEADER, "prefix_id", "prefix_tokens")  # a trace whose prompts share prefixes
UNSHAPED = TraceShape()
CONVERSATION = BurstyConfig()  # the Azure conversation trace's length medians and spreads

# shared-prefix: the system prompts' lengths and how often each is used; suffixes stay under the gaps
SYSTEM_PROMPTS: tuple[int, ...] = (1100, 1700, 2300, 2900)
SYSTEM_PROMPT_WEIGHTS: tuple[float, ...] = (0.4, 0.3, 0.2, 0.1)
SUFFIX_RANGE: tuple[int, int] = (8, 480)


# ---- the recipes ---------------------------------------------------------------------------
def long_prompt(draw: int = 0) -> list[Row]:
    """Document question answering (RAG, summarisation): long prompts, short answers.

    Arrivals: Poisson, rate ``4 * (1 + 0.3 sin(2 pi t / 90 min))`` requests/s, a slow drift between
    4.0 and 5.2 requests/s over the hour (a 90-minute swing: the hour never returns to where it started).
    Prompts: log-uniform on 4,000-8,000 tokens (a few retrieved documents; each doubling of context as
    likely). Outputs: log-normal, median 150 tokens, sigma 0.6, clipped to 16-600 (an answer or a summary
    paragraph). Shaped (token scale 0.25) a prompt is 1,000-2,000 tokens, capped at 1,536: one or two
    prefill chunks of 0.2-0.33 s each, so prefill, not decode, sizes this fleet (2-4 replicas).
    """
    rng = _rng("long-prompt", draw)
    rate = lambda t: 4.0 * (1.0 + 0.3 * math.sin(2 * math.pi * t / 5400.0))  # noqa: E731
    return [
        (t, round(math.exp(rng.uniform(math.log(4000), math.log(8000)))), _lognormal(rng, 150, 0.6, 16, 600))
        for t in _poisson(rng, rate, peak=5.2)
    ]


def code_completion(draw: int = 0) -> list[Row]:
    """Editor code completion: a context window of code, a few tokens back, many requests.

    Arrivals: Poisson with a working-day ramp compressed into the hour: 3 requests/s for the first 10
    minutes (before the day), rising linearly to 14 requests/s by minute 25 (people start working), flat
    to minute 50, then down to 5 requests/s at the end of the hour. Prompts: normal, mean 2,000 tokens, sd
    250, clipped to 1,500-2,500 (completion clients fill a fixed context budget, so prompts cluster near
    it). Outputs: log-normal, median 20 tokens, sigma 0.7, clipped to 1-100 (a line or a short block).
    Shaped, a request is ~0.1 engine-seconds, nearly all prefill: 2-3 replicas at the plateau.
    """
    rng = _rng("code-completion", draw)
    ramp = _piecewise(((0, 3.0), (600, 3.0), (1500, 14.0), (3000, 14.0), (3600, 5.0)))
    return [
        (t, round(min(2500.0, max(1500.0, rng.gauss(2000, 250)))), _lognormal(rng, 20, 0.7, 1, 100))
        for t in _poisson(rng, ramp, peak=14.0)
    ]


def long_output(draw: int = 0) -> list[Row]:
    """Reasoning-style generation: short questions, long chains of thought.

    Arrivals: Poisson, a steady 3 requests/s (low: each request holds a decode slot for minutes of
    tokens). Prompts: log-normal, median 300 tokens, sigma 0.6, clipped to 32-2,000. Outputs: log-normal,
    median 1,200 tokens, sigma 0.5, clipped to 100-4,000. Shaped, an output is ~300 tokens (capped at 512,
    a quarter of the replica's context), so decode and concurrency, not prefill, size the fleet.
    """
    rng = _rng("long-output", draw)
    return [
        (t, _lognormal(rng, 300, 0.6, 32, 2000), _lognormal(rng, 1200, 0.5, 100, 4000))
        for t in _poisson(rng, lambda t: 3.0, peak=3.0)
    ]


def bursty(draw: int = 0) -> list[Row]:
    """The synthetic bursty trace of :func:`controlplane.sim.trace.synthetic_bursty`, seed 0 (the draw),
    unchanged.

    A three-state Markov-modulated Poisson process (idle 0.5, steady 4, burst 14 requests/s; exponential
    dwells of 120, 300 and 60 s), conversation lengths (log-normal medians 1,020 and 129 tokens).
    """
    return [(r.arrival, r.prompt_len, r.output_len) for r in synthetic_bursty(BurstyConfig(seed=draw))]


def diurnal(draw: int = 0) -> list[Row]:
    """A day's load compressed into the hour: one sinusoidal period, trough at the start and the end.

    Arrivals: Poisson, rate ``16 * (0.6 - 0.4 cos(2 pi t / 1 h))`` requests/s: 3.2 requests/s (20% of
    peak, a night) at minutes 0 and 60, 16 at minute 30. Lengths: the Azure conversation trace's
    (:class:`~controlplane.sim.trace.BurstyConfig`'s log-normals, medians 1,020 and 129 tokens), so only
    the rate's shape differs from it. Shaped, 1 replica at night and 3-4 at the peak.
    """
    rng = _rng("diurnal", draw)
    rate = lambda t: 16.0 * (0.6 - 0.4 * math.cos(2 * math.pi * t / HOUR_S))  # noqa: E731
    return [(t, *_conversation(rng)) for t in _poisson(rng, rate, peak=16.0)]


def flash_crowd(draw: int = 0) -> list[Row]:
    """A flash crowd: a steady low rate, then a step to 8x for a few minutes, then back.

    Arrivals: Poisson at 2.5 requests/s; at a time drawn uniformly in minutes 15-40 the rate rises
    linearly over 10 s to 20 requests/s (8x; a link posted somewhere, a launch), holds for 2-5 minutes
    (drawn uniformly), and falls back over 30 s. Lengths: conversation (as ``diurnal``). Shaped, 1 replica
    before and after, 3-4 during the crowd, which arrives faster than a replica starts.
    """
    rng = _rng("flash-crowd", draw)
    start, hold = rng.uniform(900.0, 2400.0), rng.uniform(120.0, 300.0)
    base, crowd = 2.5, 20.0
    rate = _piecewise(
        ((0, base), (start, base), (start + 10, crowd), (start + 10 + hold, crowd),
         (start + 40 + hold, base), (HOUR_S, base))
    )
    return [(t, *_conversation(rng)) for t in _poisson(rng, rate, peak=crowd)]


def shared_prefix(draw: int = 0) -> list[Row]:
    """Chat or agent traffic behind a few long system prompts: prompts share long common prefixes.

    Arrivals: Poisson, rate ``48 * (0.6 - 0.4 cos(2 pi t / 1 h))`` requests/s, a day in the hour as in
    ``diurnal`` (9.6 requests/s at minutes 0 and 60, 48 at minute 30). Prompts: one of four system prompts
    of 1,100, 1,700, 2,300 and 2,900 tokens (used by 40%, 30%, 20% and 10% of requests: a few products or
    agents), plus a unique user suffix, log-normal median 120 tokens, sigma 0.8, clipped to 8-480.
    Outputs: conversation. Each row names its system prompt (``prefix_id`` 1-4) and its length
    (``prefix_tokens``), so the simulator's replicas can cache it as the engine's prefix cache does.

    Why this rate: a replica that has a system prompt cached prefills only the suffix, so a request costs
    a fraction of its prompt's length. At this rate a fleet sized on whole prompts would run about four
    replicas at the peak where one that counts its cache hits needs two: the trace shows whether a policy
    prices prefill by what the replicas compute. (Until 2026-12-04 this recipe ran at 6 requests/s and the
    simulator had no prefix cache; every policy sat at one replica all hour.)
    """
    rng = _rng("shared-prefix", draw)
    rate = lambda t: 48.0 * (0.6 - 0.4 * math.cos(2 * math.pi * t / HOUR_S))  # noqa: E731
    rows: list[Row] = []
    for t in _poisson(rng, rate, peak=48.0):
        prefix = rng.choices(SYSTEM_PROMPTS, weights=SYSTEM_PROMPT_WEIGHTS)[0]
        suffix = _lognormal(rng, 120, 0.8, *SUFFIX_RANGE)
        rows.append((t, prefix + suffix, _conversation_output(rng), SYSTEM_PROMPTS.index(prefix) + 1, prefix))
    return rows


RECIPES: dict[str, Callable[[int], list[Row]]] = {
    "long-prompt": long_prompt,
    "code-completion": code_completion,
    "long-output": long_output,
    "bursty": bursty,
    "diurnal": diurnal,
    "flash-crowd": flash_crowd,
    "shared-prefix": shared_prefix,
}
NAMES: tuple[str, ...] = tuple(RECIPES)


# ---- traces: regenerated or kept -------------------------------------------------------------
def evalset_rows(name: str, draw: int = 0) -> list[Row]:
    """The rows of recipe ``name`` as kept in its file (draw 0; another draw: the same recipe with other
    random numbers, traffic no policy was ever run on): arrivals rounded to milliseconds."""
    return [_rounded(row) for row in _recipe(name)(draw)]


def evalset_trace(name: str, shape: TraceShape = UNSHAPED, draw: int = 0) -> list[SimRequest]:
    """Recipe ``name`` regenerated (``draw``: as for :func:`evalset_rows`), fitted to the fleet by
    ``shape``."""
    return shaped(evalset_rows(name, draw), shape)


def load_evalset(name: str, shape: TraceShape = UNSHAPED) -> list[SimRequest]:
    """The kept file of trace ``name`` (shipped in ``controlplane.data``), fitted by ``shape``."""
    return shaped(kept_rows(name), shape)


def kept_rows(name: str) -> list[Row]:
    """The rows of the kept file of trace ``name``, at trace scale."""
    _recipe(name)
    return decode_rows(resources.files(DATA_PACKAGE).joinpath(DATA_FOLDER, f"{name}.csv.gz").read_bytes())


def encode_rows(rows: list[Row]) -> bytes:
    """CSV (header ``arrival_s,prompt_tokens,output_tokens``, then ``prefix_id,prefix_tokens`` when the
    rows carry shared prefixes; arrivals to the millisecond), gzipped with no timestamp so that the same
    rows always give the same bytes."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    shared = any(len(row) > len(HEADER) for row in rows)
    writer.writerow(PREFIX_HEADER if shared else HEADER)
    for row in rows:
        extra = (row[len(HEADER):] or (0, 0)) if shared else ()
        writer.writerow((f"{row[0]:.3f}", *row[1:len(HEADER)], *extra))
    return gzip.compress(text.getvalue().encode(), compresslevel=9, mtime=0)


def decode_rows(data: bytes) -> list[Row]:
    reader = csv.reader(io.StringIO(gzip.decompress(data).decode()))
    header = tuple(next(reader, []))
    if header == HEADER:
        return [(float(t), int(p), int(o)) for t, p, o in reader]
    if header == PREFIX_HEADER:
        return [(float(t), int(p), int(o), int(i), int(n)) for t, p, o, i, n in reader]
    raise ValueError(f"evalset file: expected header {','.join(HEADER)} (then optionally "
                     f"{','.join(PREFIX_HEADER[len(HEADER):])}), got {','.join(header)}")


def data_folder() -> Path:
    """Where the kept files live in this checkout (for writing them)."""
    return Path(str(resources.files(DATA_PACKAGE))) / DATA_FOLDER


def write_evalset(folder: Path | None = None) -> dict[str, int]:
    """Regenerate every trace into ``folder`` (default: the package's); bytes written per file."""
    folder = folder or data_folder()
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name in NAMES:
        data = encode_rows(evalset_rows(name))
        (folder / f"{name}.csv.gz").write_bytes(data)
        sizes[name] = len(data)
    return sizes


def summary(name: str, rows: list[Row]) -> str:
    """One line: requests, mean and peak-minute rate, prompt and output medians, at trace scale."""
    peak = max(minute_counts(rows), default=0) / 60
    prompt, output = statistics.median(r[1] for r in rows), statistics.median(r[2] for r in rows)
    return (
        f"{name:<16} {len(rows):>6} requests  {len(rows) / HOUR_S:5.2f} req/s mean, peak minute {peak:5.2f}  "
        f"prompt median {prompt:6.0f}  output median {output:5.0f}"
    )


def minute_counts(rows: list[Row], window_s: float = 60.0) -> list[int]:
    """Requests per window over the hour (every window, empty ones included)."""
    counts = [0] * math.ceil(HOUR_S / window_s)
    for t, *_ in rows:
        counts[min(int(t // window_s), len(counts) - 1)] += 1
    return counts


# ---- building blocks ----------------------------------------------------------------------------
def _rounded(row: Row) -> Row:
    if len(row) == 5:  # with a shared prefix
        return (round(row[0], 3), row[1], row[2], row[3], row[4])
    return (round(row[0], 3), row[1], row[2])


def _recipe(name: str) -> Callable[[int], list[Row]]:
    if name not in RECIPES:
        raise ValueError(f"evalset: unknown trace {name!r}; expected one of {', '.join(NAMES)}")
    return RECIPES[name]


def _rng(name: str, draw: int = 0) -> random.Random:
    """The recipe's random numbers: draw 0 is the kept file's."""
    return random.Random(f"evalset:{name}" if draw == 0 else f"evalset:{name}:{draw}")


def _poisson(rng: random.Random, rate: Rate, *, peak: float, duration_s: float = HOUR_S) -> Iterator[float]:
    """A non-homogeneous Poisson process by thinning: candidates at ``peak``, each kept with rate/peak."""
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return
        if rng.random() * peak < rate(t):
            yield t


def _piecewise(points: tuple[tuple[float, float], ...]) -> Rate:
    """Linear interpolation between (second, requests/s) points, flat outside them."""

    def rate(t: float) -> float:
        for (t0, r0), (t1, r1) in itertools.pairwise(points):
            if t0 <= t < t1:
                return r0 + (r1 - r0) * (t - t0) / (t1 - t0)
        return points[-1][1] if t >= points[-1][0] else points[0][1]

    return rate


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _conversation(rng: random.Random) -> tuple[int, int]:
    """Prompt and output lengths of the Azure conversation trace (``BurstyConfig``'s log-normals)."""
    c = CONVERSATION
    return _lognormal(rng, c.prompt_median, c.prompt_sigma, 1, c.max_prompt_len), _conversation_output(rng)


def _conversation_output(rng: random.Random) -> int:
    c = CONVERSATION
    return _lognormal(rng, c.output_median, c.output_sigma, 1, c.max_output_len)
