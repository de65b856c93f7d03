"""What one load run is: its target, workload, arrivals and bounds, checked before anything is sent.

The configuration stage of ``python -m inference.bench serve``: a ``LoadConfig`` (built by the CLI,
:mod:`inference.bench.serve`, or directly by drills and the replica benchmark) names a loopback target, a
dataset (:mod:`inference.bench.datasets`) and an arrival mode; ``plan_requests`` turns it into the schedule
of ``BenchRequest``, and ``assign_kinds`` draws which requests of a mixed load are plain, cancelled or bad
on purpose. :mod:`inference.bench.load_client` sends that plan. No network and no clock here.

Safety: the target must be a loopback address (``ensure_loopback``, checked when the config is built and
again when the load starts). This tool generates load; it never sends it elsewhere.
"""

from __future__ import annotations

import ipaddress
import random
import uuid
from dataclasses import dataclass

import httpx

from inference.bench.datasets import (
    BenchRequest,
    DatasetConfig,
    PromptFormat,
    build_requests,
    poisson_arrivals,
    with_arrivals,
)
from inference.bench.report import KINDS, STREAM, Slo

__all__ = [
    "BenchError",
    "LoadConfig",
    "NonLoopbackTargetError",
    "assign_kinds",
    "ensure_loopback",
    "plan_requests",
]

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)


class BenchError(Exception):
    """The run cannot start: a refused target, no model to name, a server that does not answer."""


class NonLoopbackTargetError(BenchError, ValueError):
    """The base URL points outside this machine's loopback interface."""


def ensure_loopback(base_url: str) -> None:
    """Refuse any target whose host is not 127.0.0.0/8, ``localhost`` or ``::1``; names are not resolved."""
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise NonLoopbackTargetError(f"refusing base URL {base_url!r}: {exc}") from exc
    if url.scheme not in ("http", "https") or not is_loopback_host(url.host):
        raise NonLoopbackTargetError(
            f"refusing to send load to {base_url!r}: only http(s) to a loopback host "
            "(127.0.0.0/8, localhost, ::1) is allowed")


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # any other name could resolve anywhere
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@dataclass(slots=True)
class LoadConfig:
    """One load run. Arrivals: ``concurrency`` (closed loop) or ``request_rate`` (Poisson; ``inf``: all at
    once) or, when neither is given, the trace's timestamps (traces) or all at once (random)."""

    dataset: DatasetConfig
    base_url: str = DEFAULT_BASE_URL
    endpoint: str = COMPLETIONS
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    request_rate: float | None = None
    concurrency: int | None = None
    max_concurrency: int | None = None  # cap on requests in flight, for any arrival mode
    duration: float | None = None  # stop sending after this many seconds
    grace: float = 5.0  # in-flight requests are cancelled at duration + grace
    request_timeout: float = 300.0  # per request, whole stream included
    connect_timeout: float = 10.0
    slo: Slo | None = None
    temperature: float = 0.0
    ignore_eos: bool = True  # so that every request produces exactly max_tokens tokens
    # Ask for each chunk's token ids (``return_token_ids``): a token arrives when it is streamed, also one
    # whose text is still empty (part of a character), so TTFT and TPOT count tokens, not visible text.
    token_ids: bool = False
    run_id: str = ""  # "" : a fresh random id; requests are sent with X-Request-Id "<run_id>-<index>"
    # A mixed load (``--mix``): the share of each kind of request (report.KINDS); None: streams only.
    mix: dict[str, float] | None = None
    cancel_after: int = 1  # a CANCEL request is left by the client after this many tokens

    def __post_init__(self) -> None:
        ensure_loopback(self.base_url)
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.concurrency is not None and self.request_rate is not None:
            raise ValueError("concurrency and request_rate: give one (closed loop or open loop), not both")
        _check(self.request_rate is None or self.request_rate > 0, "request_rate", self.request_rate, "> 0")
        _check(self.concurrency is None or self.concurrency >= 1, "concurrency", self.concurrency, ">= 1")
        _check(self.max_concurrency is None or self.max_concurrency >= 1, "max_concurrency",
               self.max_concurrency, ">= 1")
        _check(self.duration is None or self.duration > 0, "duration", self.duration, "> 0")
        _check(self.grace >= 0, "grace", self.grace, ">= 0")
        _check(self.request_timeout > 0, "request_timeout", self.request_timeout, "> 0")
        _check(self.connect_timeout > 0, "connect_timeout", self.connect_timeout, "> 0")
        if not self.run_id:
            self.run_id = uuid.uuid4().hex[:8]
        if self.mix is not None:
            unknown = set(self.mix) - set(KINDS)
            _check(not unknown, "mix", self.mix, f"shares of {', '.join(KINDS)} only")
            _check(all(v >= 0 for v in self.mix.values()) and sum(self.mix.values()) > 0, "mix", self.mix,
                   "shares >= 0 with a positive sum")
        _check(self.cancel_after >= 1, "cancel_after", self.cancel_after, ">= 1")

    @property
    def prompt_format(self) -> PromptFormat:
        # The replica accepts token-id prompts on /v1/completions; chat needs text.
        return "token_ids" if self.endpoint == COMPLETIONS else "text"


def assign_kinds(num: int, mix: dict[str, float] | None, seed: int) -> list[str]:
    """The kind of each of ``num`` requests, drawn by ``mix``'s shares from ``seed`` (the same every run)."""
    if not mix:
        return [STREAM] * num
    rng = random.Random(f"kinds-{seed}")
    kinds = [k for k in KINDS if mix.get(k, 0) > 0]
    return rng.choices(kinds, weights=[mix[k] for k in kinds], k=num)


def plan_requests(cfg: LoadConfig) -> list[BenchRequest]:
    """The workload with its arrival offsets (None in closed loop, where workers pace themselves)."""
    requests = build_requests(cfg.dataset)
    if cfg.concurrency is not None:
        return with_arrivals(requests, [None] * len(requests))
    if cfg.request_rate is not None:
        return with_arrivals(requests, poisson_arrivals(len(requests), cfg.request_rate, cfg.dataset.seed))
    if cfg.dataset.is_trace:
        return requests
    return with_arrivals(requests, [0.0] * len(requests))


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}: must be {rule}, got {value!r}")
