"""The simulated replica: one engine's queues, batch and KV reservations, and the requests it serves.

Where it sits: the bookkeeping of :mod:`controlplane.sim.fleet`, which moves replicas through their phases
and steps them on its event clock. A :class:`Replica` follows vLLM v1's scheduler state (a FIFO of waiting
sequences, prefilling ones, decoding ones in a heap by the step they finish at, KV space reserved for prompt
+ output on admission); a :class:`SimSequence` is one request on one replica; a :class:`RequestOutcome` is
what the request's client saw, across retries. No clock and no events here: the fleet passes the time in.

Prefix cache: as the engine does, a replica keeps the blocks a prefill computed after its sequence leaves,
and a later prompt that opens with the same whole blocks skips them (at least one token is always
computed). The simulator knows a prompt only by its lengths, so what it can share is the request's
declared shared prefix (:attr:`controlplane.sim.trace.SimRequest.prefix_id`): a replica caches each prefix
it prefilled, whole blocks of it, and evicts the least recently used when running sequences need the space.
Running sequences still reserve their whole prompt (the engine shares a cached prefix's blocks between
them), so KV pressure on such traffic is overstated, not understated.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from enum import Enum

from controlplane.autoscale.profile import ReplicaProfile

BLOCK_TOKENS = 16  # the engine's KV block (EngineConfig.block_size): a cache hit counts in whole blocks


class ReplicaPhase(Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(slots=True)
class RequestOutcome:
    """What the client of one request saw; times in seconds of simulated time."""

    arrival: float
    prompt_len: int
    output_len: int
    first_token: float | None = None
    finish: float | None = None
    retries: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None:
            return None
        return 0.0 if self.output_len <= 1 else (self.finish - self.first_token) / (self.output_len - 1)


@dataclass(slots=True)
class SimSequence:
    """One request on one replica (a resumed request starts a new one, its streamed tokens in the prompt)."""

    outcome: RequestOutcome
    prompt_len: int  # to prefill on this replica (prompt + tokens already streamed, after a resume)
    output_left: int  # tokens still to generate
    prefilled: int = 0
    prefix_id: int = 0  # the shared prefix the prompt opens with (0: none) and its tokens
    prefix_len: int = 0
    start_step: int = 0  # replica step counter when it joined the decoders
    finish_step: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.prompt_len + self.output_left


class Replica:
    def __init__(self, replica_id: int, profile: ReplicaProfile, started_at: float) -> None:
        self.replica_id = replica_id
        self.profile = profile
        self.started_at = started_at
        self.stopped_at: float | None = None
        self.phase = ReplicaPhase.STARTING
        self.waiting: deque[SimSequence] = deque()
        self.prefilling: list[SimSequence] = []
        self.decoders: list[tuple[int, int, SimSequence]] = []  # heap by finish step
        self.step = 0
        self.kv_reserved = 0
        self.decode_prompt_sum = 0  # sum of (prompt_len + 1) over decoders, for their context size
        self.decode_start_sum = 0  # sum of start_step over decoders
        # the segment in progress: ``seg_steps`` steps of ``seg_dt`` from ``seg_start``
        self.seg_start = 0.0
        self.seg_dt = 0.0
        self.seg_steps = 0
        self.seg_prefill: list[tuple[SimSequence, int]] = []
        self.version = 0
        self.busy = False
        self.prefix_cache: OrderedDict[int, int] = OrderedDict()  # prefix id -> cached tokens, LRU first
        self.prefix_cached_tokens = 0

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoders)

    @property
    def load(self) -> int:
        return len(self.waiting) + self.num_running

    @property
    def is_routable(self) -> bool:
        return self.phase is ReplicaPhase.READY

    def context_tokens(self) -> int:
        n = len(self.decoders)
        return self.decode_prompt_sum + n * self.step - self.decode_start_sum

    def kv_usage(self) -> float:
        used = self.context_tokens() + sum(s.prefilled for s in self.prefilling)
        return min(used / self.profile.kv_capacity_tokens, 1.0)

    def can_admit(self, seq: SimSequence) -> bool:
        return (
            self.num_running < self.profile.max_num_seqs
            and self.kv_reserved + seq.kv_tokens <= self.profile.kv_capacity_tokens
        )

    def take_cached_prefix(self, seq: SimSequence) -> int:
        """Tokens of ``seq``'s prompt its cached prefix spares it (whole blocks, one token left to compute),
        marking the prefix used; 0 without one."""
        cached = self.prefix_cache.get(seq.prefix_id, 0) if seq.prefix_id else 0
        if not cached:
            return 0
        self.prefix_cache.move_to_end(seq.prefix_id)
        return min(cached, (seq.prompt_len - 1) // BLOCK_TOKENS * BLOCK_TOKENS)

    def cache_prefix(self, seq: SimSequence) -> None:
        """``seq`` finished its prefill: its shared prefix's whole blocks stay cached."""
        tokens = seq.prefix_len // BLOCK_TOKENS * BLOCK_TOKENS
        if not seq.prefix_id or not tokens:
            return
        self.prefix_cached_tokens += tokens - self.prefix_cache.get(seq.prefix_id, 0)
        self.prefix_cache[seq.prefix_id] = tokens
        self.prefix_cache.move_to_end(seq.prefix_id)
        self.evict_prefixes()

    def evict_prefixes(self) -> None:
        """Least recently used prefixes out until they fit beside the running sequences' reservations."""
        capacity = self.profile.kv_capacity_tokens
        while self.prefix_cache and self.kv_reserved + self.prefix_cached_tokens > capacity:
            _, tokens = self.prefix_cache.popitem(last=False)
            self.prefix_cached_tokens -= tokens
