"""The discrete-event core of the fleet simulator: replicas that batch continuously, a router, a clock.

Where it sits: ``controlplane.sim.simulator`` feeds it a trace and a policy; every policy tick it hands the
policy an :class:`Observation` (the same signals the live autoscaler reads from telemetry) and applies the
returned replica count. Per request it records when the first token and the last token were produced.

Each replica (its bookkeeping in :mod:`controlplane.sim.replica`) follows vLLM v1's scheduler: a FIFO of
waiting requests, at most ``max_num_seqs`` running, a token budget of ``max_num_batched_tokens`` per step
spent on one token per decoding sequence first and on prefill chunks with what is left; a request's first
token comes at the end of the step that finishes its prefill. A step lasts ``profile.step_time(...)``. KV
space is reserved for prompt + output on admission (no preemption). A request whose prompt opens with a
shared prefix the replica has cached skips its whole blocks, as with the engine's prefix cache (see
:mod:`controlplane.sim.replica`); the observation carries the share of prompt tokens so served. A replica
is not ready (gets no requests) until ``start_s`` after it was started, or the profile's start beside a
busy replica (``busy_start_s``, where calibrated) when one of the others is busy; a replica being removed
drains (finishes what it runs, hands its waiting requests back to the router); a crashed replica hands
every request back and the fleet starts a replacement.

Speed: between two events a replica that only decodes runs ``k`` identical steps as one segment (until
its next sequence finishes, or until an arrival it could admit), so the cost is per request, not per
token. Within a segment the step time uses the batch's mean context (exact when the model's
``per_context_token_s`` is 0).

Shared cores (``host_cores``): by default each replica has a core of its own; given ``host_cores``, a
segment's step time is stretched by :class:`~controlplane.sim.host.SharedCores` (busy replicas, or their
CPU limits, over the cores the host's other processes leave them). The stretch is fixed for the segment;
a replica that starts or stops stepping later does not change it.

The host's speed (``speed``): a function of simulated time that multiplies every step time, read when a
segment starts; none by default (the profile's speed throughout). ``python -m controlplane.bench
sim-vs-live`` replays the speed the live replicas ran at (their profile drift, window by window) with it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from controlplane.autoscale.profile import ReplicaProfile, attention_pairs
from controlplane.sim.host import SharedCores
from controlplane.sim.replica import Replica, ReplicaPhase, RequestOutcome, SimSequence
from controlplane.sim.trace import SimRequest
from controlplane.telemetry.scraper import histogram_quantile
from inference.metrics import TTFT_BUCKETS


@dataclass(slots=True, frozen=True)
class Observation:
    """The fleet as a policy sees it at ``now`` (what the live loop reads from telemetry)."""

    now: float
    desired: int
    ready: int
    starting: int
    waiting: int  # queued in the router and on ready replicas, not yet admitted
    running: int  # admitted (prefilling or decoding)
    kv_cache_usage: float | None  # mean over ready replicas, 0..1
    ttft_p95_s: float | None  # of first tokens in the last ``metric_window_s``
    tokens_per_s: float  # generated tokens/s, fleet-wide, over the last ``metric_window_s``
    busy_share: float | None  # share of the window ready replicas spent in engine steps, 0..1
    prompt_tokens_per_s: float  # prefilled tokens/s, fleet-wide, over the last ``metric_window_s``
    arrivals_per_s: float  # over the last ``metric_window_s``
    arrivals_per_s_short: float = 0.0  # over the last ``short_window_s`` (panic mode's window)
    # the seconds of arrivals arrivals_per_s_short counts (None: the whole short window): a live loop's
    # scraped rate counts the span between the window's first and last scrapes
    panic_counted_s: float | None = None
    # share of the prompt tokens admitted in the last ``metric_window_s`` that replicas' prefix caches held
    # (vllm:prefix_cache_hits over vllm:prefix_cache_queries); None: nothing admitted
    prefix_hit_share: float | None = None
    # tokens per request, means over the requests finished in the last ``metric_window_s`` (what the
    # vllm:request_prompt_tokens and vllm:request_generation_tokens histograms give); None: none finished
    mean_prompt_tokens: float | None = None
    mean_output_tokens: float | None = None
    prompt_tokens_sd: float | None = None  # their spread (the replicas' squared-prompt-tokens counter)
    output_tokens_sd: float | None = None  # (and the squared-generation-tokens counter)
    rate_window_s: float | None = None  # what arrivals_per_s was counted over (shorter early in a run)


@dataclass(slots=True, frozen=True)
class ScaleEvent:
    at: float
    before: int
    after: int
    reason: str


@dataclass(slots=True, frozen=True)
class FleetSample:
    at: float
    desired: int
    alive: int  # starting + ready + draining: what is paid for
    ready: int
    waiting: int
    running: int


@dataclass(slots=True)
class _Clock:
    heap: list[tuple[float, int, str, object, int]] = field(default_factory=list)
    order: itertools.count[int] = field(default_factory=itertools.count)

    def push(self, at: float, kind: str, obj: object = None, version: int = 0) -> None:
        heapq.heappush(self.heap, (at, next(self.order), kind, obj, version))


PolicyFn = Callable[[Observation], tuple[int, str]]
TTFT_WINDOW = 30.0


def histogram_p95(ttfts: Sequence[float]) -> float | None:
    """P95 of the sorted ``ttfts`` as the live loop reads it: from the replicas' TTFT histogram
    (``vllm:time_to_first_token_seconds``, its buckets) by ``histogram_quantile``, which interpolates
    within a bucket. Over 1 s the buckets are wide (1, 2.5, 5 s): where the exact P95 is 1.05 s the
    histogram may read 1.7 s, past the backlog's and the guards' thresholds a tick sooner. None: none."""
    if not ttfts:
        return None
    counts = [(bound, bisect.bisect_right(ttfts, bound)) for bound in TTFT_BUCKETS]
    return histogram_quantile(0.95, [*counts, (math.inf, len(ttfts))])


class FleetSim:
    """One run: a trace through a fleet whose size a policy sets every ``tick_s``."""

    def __init__(
        self,
        profile: ReplicaProfile,
        requests: Sequence[SimRequest],
        *,
        initial_replicas: int,
        policy: PolicyFn | None,
        tick_s: float,
        duration_s: float | None = None,
        crashes: Sequence[float] = (),
        metric_window_s: float = TTFT_WINDOW,
        sample_s: float = 10.0,
        drain_limit_s: float = 600.0,
        initial_ready: bool = True,
        progress: Callable[[float, float], None] | None = None,
        short_window_s: float = 6.0,
        host_cores: int | None = None,
        speed: Callable[[float], float] | None = None,
        host_cpu_per_request_s: float = 0.0,
        first_tick_s: float | None = None,
        panic_counted_s: float | None = None,
    ) -> None:
        if initial_replicas < 0 or tick_s <= 0 or sample_s <= 0:
            raise ValueError("initial_replicas must be >= 0, tick_s and sample_s > 0")
        if first_tick_s is not None and not first_tick_s >= 0:
            raise ValueError(f"first_tick_s: must be >= 0, got {first_tick_s!r}")
        if panic_counted_s is not None and not 0 < panic_counted_s <= short_window_s:
            raise ValueError(f"panic_counted_s: must be in (0, {short_window_s:g}], got {panic_counted_s!r}")
        if host_cores is None and not host_cpu_per_request_s >= 0:  # SharedCores checks its own
            raise ValueError(f"host_cpu_per_request_s: must be >= 0, got {host_cpu_per_request_s!r}")
        self.profile = profile
        self.host = None if host_cores is None else SharedCores(
            host_cores, cpu_per_request_s=host_cpu_per_request_s, window_s=short_window_s,
            replica_cpu_limit=profile.cpu_limit)
        self.speed = speed
        self.short_window_s = short_window_s
        self.panic_counted_s = panic_counted_s  # as a live loop's scraped rate counts (None: the window)
        self.requests = sorted(requests, key=lambda r: r.arrival)
        self.duration = (
            duration_s if duration_s is not None else max((r.arrival for r in requests), default=0.0)
        )
        self.policy, self.tick_s = policy, tick_s
        self.first_tick_s = tick_s if first_tick_s is None else first_tick_s  # a live loop's phase
        self.metric_window_s, self.sample_s = metric_window_s, sample_s
        self.hard_end = self.duration + drain_limit_s
        self.clock = _Clock()
        self.replicas: list[Replica] = []
        self.router: deque[SimSequence] = deque()  # nowhere ready to go yet
        self.outcomes: list[RequestOutcome] = []
        self.events: list[ScaleEvent] = []
        self.samples: list[FleetSample] = []
        self.desired = initial_replicas
        self.now = 0.0
        self._first_tokens: deque[tuple[float, float]] = deque()  # (time, ttft)
        self._tokens: deque[tuple[float, int]] = deque()  # (time, tokens generated)
        self._prompt_tokens: deque[tuple[float, int]] = deque()  # (time, tokens prefilled)
        self._arrivals: deque[float] = deque()
        self._finished: deque[tuple[float, int, int]] = deque()  # (time, prompt, output tokens)
        self._prefix: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens admitted, cache hits)
        self._busy: deque[tuple[float, float]] = deque()  # (time, engine seconds), fleet-wide
        self._unfinished = 0
        self.progress = progress
        for _ in range(initial_replicas):
            self._start_replica(ready_now=initial_ready)
        for at in crashes:
            self.clock.push(at, "crash")

    # ---- the run -------------------------------------------------------------------------------
    def run(self) -> FleetSim:
        if self.policy is not None:
            self.clock.push(self.first_tick_s, "tick")
        self.clock.push(0.0, "sample")
        arrivals = iter(self.requests)
        upcoming = next(arrivals, None)
        while True:
            next_event = self.clock.heap[0][0] if self.clock.heap else math.inf
            if upcoming is not None and upcoming.arrival <= next_event:
                self.now = upcoming.arrival
                self._arrive(upcoming)
                upcoming = next(arrivals, None)
                continue
            if next_event > self.hard_end or (upcoming is None and self._is_done()):
                break
            at, _, kind, obj, version = heapq.heappop(self.clock.heap)
            self.now = at
            self._handle(kind, obj, version)
        self.now = min(self.now, self.hard_end)
        return self

    def _is_done(self) -> bool:
        return self._unfinished == 0 and self.now >= self.duration

    def _finish(self, outcome: RequestOutcome) -> None:
        outcome.finish = self.now
        self._unfinished -= 1
        self._finished.append((self.now, outcome.prompt_len, outcome.output_len))

    def _handle(self, kind: str, obj: object, version: int) -> None:
        if kind == "step":
            assert isinstance(obj, Replica)
            if version == obj.version:
                self._end_segment(obj)
        elif kind == "ready":
            assert isinstance(obj, Replica)
            if obj.phase is ReplicaPhase.STARTING:
                obj.phase = ReplicaPhase.READY
                self._dispatch_router()
        elif kind == "tick":
            self._tick()
        elif kind == "sample":
            self._sample()
        elif kind == "crash":
            self._crash()

    # ---- requests ------------------------------------------------------------------------------
    def _arrive(self, request: SimRequest) -> None:
        prompt = min(request.prompt_len, self.profile.max_model_len - 1)
        output = max(1, min(request.output_len, self.profile.max_model_len - prompt))
        outcome = RequestOutcome(request.arrival, prompt, output)
        self.outcomes.append(outcome)
        self._unfinished += 1
        self._arrivals.append(self.now)
        if self.host is not None:
            self.host.arrived(self.now)
        self._route(SimSequence(outcome, prompt, output, prefix_id=request.prefix_id,
                                prefix_len=min(request.prefix_len, prompt)))

    def _route(self, seq: SimSequence) -> None:
        """Least outstanding requests among ready replicas (the gateway's least-request pick)."""
        candidates = [r for r in self.replicas if r.is_routable]
        if not candidates:
            self.router.append(seq)
            return
        replica = min(candidates, key=lambda r: r.load)
        replica.waiting.append(seq)
        self._poke(replica)

    def _dispatch_router(self) -> None:
        while self.router and any(r.is_routable for r in self.replicas):
            self._route(self.router.popleft())

    # ---- a replica's steps ---------------------------------------------------------------------
    def _poke(self, replica: Replica) -> None:
        """New work for ``replica``: start stepping if idle, or cut a long decode segment short."""
        if not replica.busy:
            # step after every arrival of this instant has been routed: they share the first step
            replica.busy, replica.seg_start, replica.seg_dt, replica.seg_steps = True, self.now, 0.0, 0
            replica.version += 1
            self.clock.push(self.now, "step", replica, replica.version)
            return
        if replica.seg_steps <= 1 or not replica.waiting or not replica.can_admit(replica.waiting[0]):
            return
        done = math.floor((self.now - replica.seg_start) / replica.seg_dt) + 1  # the step in progress ends
        if done < replica.seg_steps:
            replica.seg_steps = done
            replica.version += 1
            self.clock.push(replica.seg_start + done * replica.seg_dt, "step", replica, replica.version)

    def _start_segment(self, replica: Replica) -> None:
        while replica.waiting and replica.can_admit(replica.waiting[0]):
            seq = replica.waiting.popleft()
            replica.kv_reserved += seq.kv_tokens
            seq.prefilled = replica.take_cached_prefix(seq)
            self._prefix.append((self.now, seq.prompt_len, seq.prefilled))
            replica.prefilling.append(seq)
        replica.evict_prefixes()
        n = len(replica.decoders)
        budget = replica.profile.max_num_batched_tokens - n
        chunks: list[tuple[SimSequence, int]] = []
        for seq in replica.prefilling:
            if budget <= 0:
                break
            take = min(seq.prompt_len - seq.prefilled, budget)
            chunks.append((seq, take))
            budget -= take
        replica.seg_prefill = chunks
        if chunks:
            steps = 1
            dt = replica.profile.step_time(
                num_decode=n,
                num_prefill_tokens=sum(c for _, c in chunks),
                context_tokens=replica.context_tokens(),
                prefill_pairs=sum(attention_pairs(take, seq.prefilled) for seq, take in chunks),
            )
        elif n:
            steps = replica.decoders[0][0] - replica.step
            mean_context = replica.context_tokens() + n * (steps - 1) / 2
            dt = replica.profile.step_time(
                num_decode=n, num_prefill_tokens=0, context_tokens=round(mean_context)
            )
        else:
            replica.busy = False
            self._maybe_stop(replica)
            return
        replica.busy = True
        shared = 1.0 if self.host is None else self.host.stretch(sum(r.busy for r in self.replicas), self.now)
        dt *= shared * (1.0 if self.speed is None else self.speed(self.now))
        replica.seg_start, replica.seg_dt, replica.seg_steps = self.now, dt, steps
        replica.version += 1
        self.clock.push(self.now + steps * dt, "step", replica, replica.version)

    def _end_segment(self, replica: Replica) -> None:
        steps = replica.seg_steps
        replica.step += steps
        self._busy.append((self.now, steps * replica.seg_dt))
        self._tokens.append((self.now, steps * len(replica.decoders)))
        if replica.seg_prefill:
            self._prompt_tokens.append((self.now, sum(take for _, take in replica.seg_prefill)))
        while replica.decoders and replica.decoders[0][0] <= replica.step:
            _, _, seq = heapq.heappop(replica.decoders)
            self._leave_decoders(replica, seq)
            self._finish(seq.outcome)
        for seq, take in replica.seg_prefill:
            seq.prefilled += take
            if seq.prefilled >= seq.prompt_len:
                replica.prefilling.remove(seq)
                replica.cache_prefix(seq)
                self._first_token(replica, seq)
        replica.seg_prefill = []
        self._start_segment(replica)

    def _first_token(self, replica: Replica, seq: SimSequence) -> None:
        outcome = seq.outcome
        if outcome.first_token is None:
            outcome.first_token = self.now
            self._first_tokens.append((self.now, self.now - outcome.arrival))
        self._tokens.append((self.now, 1))
        seq.output_left -= 1
        if seq.output_left <= 0:
            replica.kv_reserved -= seq.prompt_len + 1
            self._finish(outcome)
            return
        seq.start_step, seq.finish_step = replica.step, replica.step + seq.output_left
        replica.decode_prompt_sum += seq.prompt_len + 1
        replica.decode_start_sum += seq.start_step
        heapq.heappush(replica.decoders, (seq.finish_step, id(seq), seq))

    def _leave_decoders(self, replica: Replica, seq: SimSequence) -> None:
        replica.decode_prompt_sum -= seq.prompt_len + 1
        replica.decode_start_sum -= seq.start_step
        replica.kv_reserved -= seq.prompt_len + 1 + (seq.finish_step - seq.start_step)

    # ---- fleet ---------------------------------------------------------------------------------
    def _start_replica(self, *, ready_now: bool = False) -> Replica:
        replica = Replica(len(self.replicas), self.profile, self.now)
        self.replicas.append(replica)
        if ready_now:
            replica.phase = ReplicaPhase.READY
        else:
            # beside a busy replica a start shares the cores with it (the profile's busy start, when
            # measured); on an idle fleet it has them to itself
            busy = any(r.busy for r in self.replicas)
            start = self.profile.scale_up_start_s if busy else self.profile.start_s
            self.clock.push(self.now + start, "ready", replica)
        return replica

    def _alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.phase in (ReplicaPhase.STARTING, ReplicaPhase.READY)]

    def _set_desired(self, desired: int, reason: str) -> None:
        if desired != self.desired:
            self.events.append(ScaleEvent(self.now, self.desired, desired, reason))
        self.desired = desired
        alive = self._alive()
        for _ in range(desired - len(alive)):
            self._start_replica()
        if len(alive) > desired:
            # remove replicas still starting first (newest first), then the least loaded ready ones
            order = sorted(alive, key=lambda r: (r.phase is ReplicaPhase.READY, r.load, -r.started_at))
            for replica in order[: len(alive) - desired]:
                self._drain(replica)

    def _drain(self, replica: Replica) -> None:
        was_ready = replica.phase is ReplicaPhase.READY
        replica.phase = ReplicaPhase.DRAINING
        handback = list(replica.waiting)
        replica.waiting.clear()
        for seq in handback:
            self._route(seq)
        if not was_ready or not replica.busy:
            self._maybe_stop(replica)

    def _maybe_stop(self, replica: Replica) -> None:
        if replica.phase is ReplicaPhase.DRAINING and replica.num_running == 0 and not replica.waiting:
            replica.phase, replica.stopped_at = ReplicaPhase.STOPPED, self.now
            replica.version += 1

    def _crash(self) -> None:
        """The busiest ready replica dies; its requests resume elsewhere and the fleet replaces it."""
        ready = [r for r in self.replicas if r.phase is ReplicaPhase.READY]
        if not ready:
            return
        victim = max(ready, key=lambda r: (r.load, -r.replica_id))
        victim.phase, victim.stopped_at = ReplicaPhase.STOPPED, self.now
        victim.version += 1
        victim.busy = False
        lost = list(victim.waiting) + victim.prefilling + [s for _, _, s in victim.decoders]
        generated = {id(s): victim.step - s.start_step for _, _, s in victim.decoders}
        victim.waiting.clear()
        victim.prefilling, victim.decoders = [], []
        self._set_desired(self.desired, "replace crashed replica")
        for seq in lost:
            done = generated.get(id(seq), 0)
            streamed = done + (1 if id(seq) in generated else 0)
            seq.outcome.retries += 1
            # the gateway resumes from what was streamed: prompt + streamed tokens, the rest to generate
            self._route(
                SimSequence(
                    seq.outcome,
                    min(seq.prompt_len + streamed, self.profile.max_model_len - 1),
                    max(seq.output_left - done, 1),
                    prefix_id=seq.prefix_id,
                    prefix_len=seq.prefix_len,
                )
            )

    # ---- policy and observation ----------------------------------------------------------------
    def observe(self) -> Observation:
        cutoff = self.now - self.metric_window_s
        for q in (self._first_tokens, self._tokens, self._busy, self._prompt_tokens, self._prefix):
            while q and q[0][0] < cutoff:
                q.popleft()
        while self._arrivals and self._arrivals[0] < cutoff:
            self._arrivals.popleft()
        while self._finished and self._finished[0][0] < cutoff:
            self._finished.popleft()
        short = min(self.panic_counted_s or self.short_window_s, max(self.now, 1e-9))
        num_short = len(self._arrivals) - bisect.bisect_left(self._arrivals, self.now - short)
        ready = [r for r in self.replicas if r.phase is ReplicaPhase.READY]
        starting = sum(r.phase is ReplicaPhase.STARTING for r in self.replicas)
        ttfts = sorted(t for _, t in self._first_tokens)
        window = min(self.metric_window_s, max(self.now, 1e-9))
        return Observation(
            now=self.now,
            desired=self.desired,
            ready=len(ready),
            starting=starting,
            waiting=len(self.router) + sum(len(r.waiting) for r in ready),
            running=sum(r.num_running for r in self.replicas if r.phase is not ReplicaPhase.STOPPED),
            kv_cache_usage=sum(r.kv_usage() for r in ready) / len(ready) if ready else None,
            ttft_p95_s=histogram_p95(ttfts),
            tokens_per_s=sum(n for _, n in self._tokens) / window,
            prompt_tokens_per_s=sum(n for _, n in self._prompt_tokens) / window,
            busy_share=min(sum(b for _, b in self._busy) / (window * len(ready)), 1.0) if ready else None,
            arrivals_per_s=len(self._arrivals) / window,
            rate_window_s=window,
            arrivals_per_s_short=num_short / short,
            panic_counted_s=self.panic_counted_s,
            mean_prompt_tokens=_mean(p for _, p, _ in self._finished),
            mean_output_tokens=_mean(o for _, _, o in self._finished),
            prompt_tokens_sd=_sd([p for _, p, _ in self._finished]),
            output_tokens_sd=_sd([o for _, _, o in self._finished]),
            prefix_hit_share=_share(self._prefix),
        )

    def _tick(self) -> None:
        assert self.policy is not None
        desired, reason = self.policy(self.observe())
        self._set_desired(desired, reason)
        if self.now + self.tick_s <= self.duration:
            self.clock.push(self.now + self.tick_s, "tick")

    def _sample(self) -> None:
        obs = self.observe()
        alive = sum(r.phase is not ReplicaPhase.STOPPED for r in self.replicas)
        self.samples.append(FleetSample(self.now, self.desired, alive, obs.ready, obs.waiting, obs.running))
        if self.progress is not None:
            self.progress(self.now, self.duration)
        if self.now + self.sample_s <= self.duration:
            self.clock.push(self.now + self.sample_s, "sample")

    def replica_seconds(self) -> float:
        """Seconds paid for over ``[0, duration]``: every replica from its start until it stopped."""
        total = 0.0
        for r in self.replicas:
            end = self.duration if r.stopped_at is None else min(r.stopped_at, self.duration)
            total += max(end - min(r.started_at, self.duration), 0.0)
        return total


def _mean(values: Iterable[float]) -> float | None:
    total, count = 0.0, 0
    for v in values:
        total, count = total + v, count + 1
    return total / count if count else None


def _share(admitted: Iterable[tuple[float, int, int]]) -> float | None:
    queried = hits = 0
    for _, q, h in admitted:
        queried, hits = queried + q, hits + h
    return hits / queried if queried else None


def _sd(values: list[float]) -> float | None:
    """The population standard deviation (what a sum, a sum of squares and a count give); None when empty."""
    if not values:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(max(sum(v * v for v in values) / len(values) - mean * mean, 0.0))
