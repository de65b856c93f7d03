"""What the load client measured: per-request records, and the summary a client would see.

The last stage of ``python -m inference.bench serve``: ``load_client.py`` fills one ``RequestRecord`` per
request sent, ``summarize`` turns them into latency distributions (TTFT, TPOT, ITL, E2EL), throughput,
goodput under SLOs, errors by kind and requests per replica. Records travel as JSON lines
(``write_jsonl``/``read_jsonl``) to drills, which read RTO and RPO off the client-side timeline. Only
arithmetic and file writing here.

Definitions follow ``vllm bench serve``: latencies count successful requests only; TPOT is
``(e2el - ttft) / (output tokens - 1)``; ITL is every gap between consecutive token-carrying chunks.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
SERVER_STAGES = ("queue", "prefill", "decode", "detokenize", "serialize")
SLO_METRICS = ("ttft", "tpot", "e2el")
UNKNOWN_REPLICA = "unknown"

# Error kinds; an HTTP error is "http_<status>" (http_429, http_503, ...).
CONNECT_ERROR = "connect_error"
TIMEOUT = "timeout"
STREAM_CUT = "stream_cut"  # the stream ended (or broke) before data: [DONE]
STREAM_ERROR = "stream_error"  # the server sent an OpenAI error object inside the stream
CANCELLED = "cancelled"  # still running when the run's duration (plus grace) ran out
PROTOCOL_ERROR = "protocol_error"  # a chunk that is not JSON, or a response that is not an event stream

# What a request of a mixed load is (``serve --mix``): each kind succeeds in its own way.
STREAM = "stream"  # streamed to [DONE]
PLAIN = "plain"  # not streamed: one JSON answer with its usage
CANCEL = "cancel"  # streamed, and left by the client after its first tokens (``--cancel-after``)
BAD = "bad"  # invalid on purpose: it must be refused with a 4xx in the OpenAI error shape
KINDS = (STREAM, PLAIN, CANCEL, BAD)
CLIENT_CANCELLED = "client_cancelled"  # finish_reason of a CANCEL request the client left as planned


def http_error_kind(status: int) -> str:
    return f"http_{status}"


@dataclass(slots=True, frozen=True)
class ServerTimings:
    """The replica's own account of a request (seconds), from the ``timings`` field of its last chunk."""

    queue: float | None = None
    prefill: float | None = None
    decode: float | None = None
    detokenize: float | None = None
    serialize: float | None = None
    replica: str | None = None

    @classmethod
    def from_json(cls, obj: object) -> ServerTimings | None:
        """Tolerant: unknown keys are ignored and a non-numeric stage is dropped, never fatal."""
        if not isinstance(obj, dict):
            return None
        stages = {s: float(v) for s in SERVER_STAGES
                  if isinstance(v := obj.get(s), int | float) and not isinstance(v, bool)}
        replica = obj.get("replica")
        return cls(**stages, replica=None if replica is None else str(replica))

    def stage(self, name: str) -> float | None:
        value: float | None = getattr(self, name)
        return value


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds since the run's start (monotonic clock),
    except ``send_wall`` (POSIX seconds, to line the timeline up with other processes' logs)."""

    index: int
    request_id: str  # sent as X-Request-Id
    prompt_len: int  # planned
    output_len: int  # planned, sent as max_tokens
    scheduled_time: float | None = None  # planned arrival; None in closed loop
    send_time: float = 0.0
    send_wall: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    status: int | None = None
    error_kind: str | None = None
    error_type: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    retry_after: float | None = None  # seconds, from Retry-After; recorded, never obeyed
    response_id: str | None = None
    prompt_tokens: int | None = None  # from usage
    completion_tokens: int | None = None  # from usage
    finish_reason: str | None = None
    replica_id: str | None = None  # x-replica-id response header
    tried: tuple[str, ...] = ()  # x-gateway-tried: replicas a gateway tried first, which failed
    timings: ServerTimings | None = None
    kind: str = STREAM  # see KINDS

    @property
    def is_success(self) -> bool:
        """The request ended as its kind intends: a bad one refused with a 4xx error object, any other
        answered with status 200 and read to its end (a cancel: to the token where the client left)."""
        if self.kind == BAD:
            return self.status is not None and 400 <= self.status < 500 and self.error_type is not None
        return self.error_kind is None and self.status == 200 and self.end_time is not None

    @property
    def num_output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times)

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    @property
    def replica(self) -> str | None:
        if self.replica_id is not None:
            return self.replica_id
        return None if self.timings is None else self.timings.replica

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def e2el(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        ttft, e2el, n = self.ttft, self.e2el, self.num_output_tokens
        if ttft is None or e2el is None or n < 2:
            return None
        return (e2el - ttft) / (n - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def to_json(self) -> dict[str, Any]:
        """Everything recorded, plus the derived latencies (s) so that readers need not recompute them."""
        return {**asdict(self), "success": self.is_success, "num_output_tokens": self.num_output_tokens,
                "replica": self.replica, "ttft": self.ttft, "tpot": self.tpot, "e2el": self.e2el}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RequestRecord:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in obj.items() if k in known}
        values["timings"] = ServerTimings.from_json(values.get("timings"))
        values["tried"] = tuple(str(r) for r in values.get("tried") or ())
        return cls(**values)


@dataclass(slots=True, frozen=True)
class Slo:
    """Per-request latency objectives in ms; a request is good when it succeeded within every one given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in SLO_METRICS:
            value = getattr(self, f"{name}_ms")
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"slo {name}: must be a positive number of ms, got {value!r}")

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``ttft=500,tpot=100`` (ms) -> Slo; metrics are ttft, tpot, e2el."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, raw = part.partition("=")
            name = name.strip().lower()
            if not sep or name not in SLO_METRICS:
                raise ValueError(f"slo: expected metric=ms with metric in {SLO_METRICS}, got {part!r}")
            try:
                values[f"{name}_ms"] = float(raw)
            except ValueError as exc:
                raise ValueError(f"slo {name}: not a number: {raw!r}") from exc
        if not values:
            raise ValueError("slo: give at least one of ttft=MS, tpot=MS, e2el=MS")
        return cls(**values)

    def is_met_by(self, record: RequestRecord) -> bool:
        if not record.is_success:
            return False
        return all(limit is None or (value or 0.0) * 1000.0 <= limit
                   for limit, value in ((self.ttft_ms, record.ttft), (self.tpot_ms, record.tpot),
                                        (self.e2el_ms, record.e2el)))

    def describe(self) -> str:
        return ",".join(f"{m}={v:g}" for m in SLO_METRICS if (v := getattr(self, f"{m}_ms")) is not None)


@dataclass(slots=True, frozen=True)
class Distribution:
    """Mean, percentiles and max of latency samples, in ms (None without samples)."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of_seconds(cls, samples: Sequence[float]) -> Distribution:
        if not samples:
            return cls()
        ms = np.asarray(samples, dtype=np.float64) * 1000.0
        p50, p90, p95, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(count=len(ms), mean=float(ms.mean()), p50=p50, p90=p90, p95=p95, p99=p99,
                   max=float(ms.max()))


@dataclass(slots=True, frozen=True)
class Goodput:
    slo: Slo
    num_good: int
    request_rate: float  # good requests per second of the run
    percent: float  # of requests sent


@dataclass(slots=True)
class LoadSummary:
    num_requests: int  # sent
    num_completed: int
    num_failed: int
    duration: float  # seconds, from the run's start to its last response
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tokens of completed requests/s
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    goodput: Goodput | None
    errors: dict[str, int]
    replicas: dict[str, int]
    server_timings: dict[str, Distribution]


def summarize(records: Sequence[RequestRecord], *, duration: float, slo: Slo | None = None) -> LoadSummary:
    ok = [r for r in records if r.is_success]
    per_second = 1.0 / duration if duration > 0 else 0.0
    output_tokens = sum(r.num_output_tokens for r in ok)
    return LoadSummary(
        num_requests=len(records), num_completed=len(ok), num_failed=len(records) - len(ok),
        duration=duration,
        total_input_tokens=sum(r.num_prompt_tokens for r in ok), total_output_tokens=output_tokens,
        request_throughput=len(ok) * per_second, output_throughput=output_tokens * per_second,
        ttft=Distribution.of_seconds(_present(r.ttft for r in ok)),
        tpot=Distribution.of_seconds(_present(r.tpot for r in ok)),
        itl=Distribution.of_seconds([gap for r in ok for gap in r.itls]),
        e2el=Distribution.of_seconds(_present(r.e2el for r in ok)),
        goodput=None if slo is None else goodput(records, slo, duration=duration),
        errors=dict(sorted(Counter(r.error_kind or "unknown" for r in records if not r.is_success).items())),
        replicas=dict(sorted(Counter(r.replica or UNKNOWN_REPLICA for r in records
                                     if r.status is not None).items())),
        server_timings=_server_timings(ok),
    )


def goodput(records: Sequence[RequestRecord], slo: Slo, *, duration: float) -> Goodput:
    good = sum(slo.is_met_by(r) for r in records)
    return Goodput(slo=slo, num_good=good, request_rate=good / duration if duration > 0 else 0.0,
                   percent=100.0 * good / len(records) if records else 0.0)


def _present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def _server_timings(ok: Sequence[RequestRecord]) -> dict[str, Distribution]:
    timed = [r.timings for r in ok if r.timings is not None]
    stages = {s: Distribution.of_seconds(_present(t.stage(s) for t in timed)) for s in SERVER_STAGES}
    return {s: d for s, d in stages.items() if d.count}


@dataclass(slots=True)
class LoadReport:
    """A finished run: what was targeted, when it started, every request, and the summary."""

    run_id: str
    base_url: str
    endpoint: str
    model: str
    start_wall: float  # POSIX seconds at the run's time zero
    records: list[RequestRecord]
    summary: LoadSummary

    def to_json(self) -> dict[str, Any]:
        """The summary document of ``--result-json`` (records go to JSONL, not here)."""
        return {"run_id": self.run_id, "base_url": self.base_url, "endpoint": self.endpoint,
                "model": self.model, "start_wall": self.start_wall, **asdict(self.summary)}


def write_result_json(report: LoadReport, path: Path) -> None:
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n")


def write_jsonl(records: Iterable[RequestRecord], path: Path) -> None:
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record.to_json()) + "\n")


def read_jsonl(path: Path) -> list[RequestRecord]:
    with path.open() as f:
        return [RequestRecord.from_json(json.loads(line)) for line in f if line.strip()]


def format_table(report: LoadReport) -> str:
    """The human summary: run facts, then one latency row per metric, then errors and replicas."""
    s = report.summary
    facts: list[tuple[str, str]] = [
        ("Requests sent", str(s.num_requests)), ("Successful requests", str(s.num_completed)),
        ("Failed requests", str(s.num_failed)), ("Duration (s)", f"{s.duration:.2f}"),
        ("Total input tokens", str(s.total_input_tokens)),
        ("Total output tokens", str(s.total_output_tokens)),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.2f}"),
    ]
    if s.goodput is not None:
        g = s.goodput
        facts.append((f"Goodput [{g.slo.describe()}] (req/s)", f"{g.request_rate:.2f}"))
        facts.append(("Goodput (% of requests)", f"{g.percent:.1f}"))
    sections = [facts]
    if s.errors:
        sections.append([("Errors by kind", ""), *((f"  {k}", str(v)) for k, v in s.errors.items())])
    if s.replicas:
        sections.append([("Requests per replica", ""), *((f"  {k}", str(v)) for k, v in s.replicas.items())])
    key_width = max(len(k) for section in sections for k, _ in section) + 2
    value_width = max(len(v) for section in sections for _, v in section)
    tables = ["\n".join(f"{k + ':' if v else k:<{key_width}}{v:>{value_width}}".rstrip() for k, v in section)
              for section in sections]
    rows = [("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2EL", s.e2el)]
    rows += [(f"server {stage}", d) for stage, d in s.server_timings.items()]
    header = f"Run {report.run_id}: {report.base_url}{report.endpoint}, model {report.model}"
    return "\n\n".join([header, tables[0], "\n".join(_latency_table(rows)), *tables[1:]])


def _latency_table(rows: Sequence[tuple[str, Distribution]]) -> list[str]:
    columns = ("count", "mean", "p50", "p90", "p95", "p99", "max")
    title = "latency (ms)"
    width = max(len(title), *(len(name) for name, _ in rows)) + 2
    header = f"{title:<{width}}" + "".join(f"{c:>10}" for c in columns)
    body = [f"{name:<{width}}{d.count:>10}"
            + "".join(f"{_ms(getattr(d, c)):>10}" for c in columns[1:]) for name, d in rows]
    return [header, *body]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
