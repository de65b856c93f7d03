"""Where the gateway sends a request: filter the fleet's replicas, score them, pick one.

The gateway builds one :class:`Candidate` per replica it knows (the fleet's endpoint snapshot, the last
load scraped from the replica's /metrics, the gateway's own in-flight count and whether it ejected the
replica) and asks a :class:`Router` for a :class:`RoutingDecision`. Everything here is pure bookkeeping:
no I/O, no clock; randomness only through an injectable :class:`random.Random`, so every policy is
unit-tested on synthetic inputs.

Policies (``GatewayConfig.routing``):

- ``score`` (default): lowest score wins. The score grows with the replica's waiting queue, its KV-cache
  usage and the requests the gateway has in flight on it, and shrinks with prefix affinity: the chained
  hashes of the prompt's leading full blocks that the replica served recently (its prefix cache likely
  still holds them, so the prefill is cheaper there).
- ``round-robin``: the routable replicas in id order, one after the other.
- ``least-request``: fewest requests in flight from the gateway.
- ``power-of-two``: two random routable replicas; the one with fewer in flight wins.

Ties always go to the lower replica id, so a decision is a function of its inputs.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from controlplane.gateway.config import ROUTING_POLICIES
from controlplane.replicas import ReplicaEndpoint, ReplicaLoad
from inference.kv_blocks import prefix_block_hashes

AFFINITY_BLOCK_SIZE = 16  # the replicas' KV block size: affinity is tracked per full block
AFFINITY_ENTRIES_PER_REPLICA = 4096  # block hashes remembered per replica (LRU)


@dataclass(slots=True, frozen=True)
class Candidate:
    """One replica as routing sees it at the moment of a decision."""

    endpoint: ReplicaEndpoint
    load: ReplicaLoad | None = None  # None: no metrics scraped yet (counts as idle)
    num_inflight: int = 0  # requests the gateway has in flight on it
    is_ejected: bool = False  # by the gateway's outlier detection

    @property
    def replica_id(self) -> str:
        return self.endpoint.replica_id

    def __post_init__(self) -> None:
        if self.num_inflight < 0:
            raise ValueError(f"num_inflight: must be >= 0, got {self.num_inflight}")


@dataclass(slots=True, frozen=True)
class ScoreWeights:
    """How much each signal weighs in the ``score`` policy (lower score wins).

    One waiting request and one in-flight request cost 1 each; a full KV cache costs as much as four
    waiting requests (it means preemptions soon); a replica that served the whole prompt prefix before
    gets up to ``affinity`` off (a prefill it can mostly skip is worth about two queued requests).
    """

    waiting: float = 1.0
    kv_usage: float = 4.0
    inflight: float = 1.0
    affinity: float = 2.0

    def __post_init__(self) -> None:
        for name in ("waiting", "kv_usage", "inflight", "affinity"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")


@dataclass(slots=True, frozen=True)
class RoutingDecision:
    """The outcome of one pick, kept for traces and debugging."""

    policy: str
    replica_id: str | None  # None: no routable replica
    scores: tuple[tuple[str, float], ...] = ()  # (replica id, score) per routable candidate, lower first
    excluded: tuple[str, ...] = ()  # replicas filtered out for this request (tried, ejected, not ready)
    affinity_blocks: int = 0  # leading prompt blocks the chosen replica served recently

    @property
    def is_routed(self) -> bool:
        return self.replica_id is not None


# ---- filter ----------------------------------------------------------------------------------
def is_routable(candidate: Candidate, exclude: Iterable[str] = ()) -> bool:
    """READY (so not starting, draining, crashed or stopped), not ejected, not already tried."""
    return (candidate.endpoint.state.is_routable and not candidate.is_ejected
            and candidate.replica_id not in set(exclude))


def routable(candidates: Iterable[Candidate], exclude: Iterable[str] = ()) -> list[Candidate]:
    """The routable candidates in replica-id order (the order every tie-break relies on)."""
    excluded = set(exclude)
    return sorted((c for c in candidates if is_routable(c, excluded)), key=lambda c: c.replica_id)


# ---- prefix affinity -------------------------------------------------------------------------
def prompt_block_hashes(units: Sequence[int], block_size: int = AFFINITY_BLOCK_SIZE) -> list[int]:
    """The chained hashes of the prompt's full leading blocks (the replicas' prefix-cache keys)."""
    return prefix_block_hashes(units, block_size)


@dataclass(slots=True)
class PrefixAffinity:
    """Which replica recently served which prompt prefixes: a bounded LRU of block hashes per replica."""

    capacity_per_replica: int = AFFINITY_ENTRIES_PER_REPLICA
    _seen: dict[str, OrderedDict[int, None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity_per_replica < 1:
            raise ValueError(f"capacity_per_replica: must be >= 1, got {self.capacity_per_replica}")

    def remember(self, replica_id: str, block_hashes: Sequence[int]) -> None:
        """Record that ``replica_id`` served a prompt with these leading blocks."""
        seen = self._seen.setdefault(replica_id, OrderedDict())
        for h in block_hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity_per_replica:
            seen.popitem(last=False)

    def num_matched(self, replica_id: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt the replica served recently.

        Hashes are chained, so the deepest remembered hash implies every block before it.
        """
        seen = self._seen.get(replica_id)
        if not seen:
            return 0
        for depth in range(len(block_hashes), 0, -1):
            if block_hashes[depth - 1] in seen:
                return depth
        return 0

    def forget(self, replica_id: str) -> None:
        """Drop a replica's history (it restarted: its prefix cache is empty)."""
        self._seen.pop(replica_id, None)


# ---- scores and picks ------------------------------------------------------------------------
def load_score(candidate: Candidate, weights: ScoreWeights) -> float:
    """The load part of the score: waiting requests, KV usage and gateway in-flight requests."""
    load = candidate.load
    waiting = load.num_waiting if load is not None else 0.0
    kv_usage = load.kv_cache_usage if load is not None else 0.0
    return (weights.waiting * waiting + weights.kv_usage * kv_usage
            + weights.inflight * candidate.num_inflight)


def affinity_bonus(num_matched: int, num_blocks: int, weights: ScoreWeights) -> float:
    """The share of the prompt's blocks the replica served recently, times the affinity weight."""
    return weights.affinity * num_matched / num_blocks if num_blocks else 0.0


def best(scored: Sequence[tuple[str, float]]) -> str:
    """The lowest score; ties go to the lower replica id."""
    return min(scored, key=lambda item: (item[1], item[0]))[0]


class Router:
    """Picks a replica for a request under one policy; keeps round-robin and affinity state."""

    def __init__(self, policy: str = "score", *, weights: ScoreWeights | None = None,
                 affinity: PrefixAffinity | None = None, rng: random.Random | None = None) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.weights = weights or ScoreWeights()
        self.affinity = affinity or PrefixAffinity()
        self.rng = rng or random.Random()
        self._next = 0  # round-robin position

    def pick(self, candidates: Sequence[Candidate], *, block_hashes: Sequence[int] = (),
             exclude: Iterable[str] = ()) -> RoutingDecision:
        """Filter, score, pick. ``exclude``: replicas already tried for this request."""
        pool = routable(candidates, exclude)
        excluded = tuple(sorted({c.replica_id for c in candidates} - {c.replica_id for c in pool}))
        if not pool:
            return RoutingDecision(self.policy, None, excluded=excluded)
        scores = self._scores(pool, block_hashes)
        chosen = self._choose(pool, scores)
        return RoutingDecision(self.policy, chosen, tuple(sorted(scores, key=lambda s: (s[1], s[0]))),
                               excluded, self.affinity.num_matched(chosen, block_hashes))

    def remember(self, replica_id: str, block_hashes: Sequence[int]) -> None:
        """After a replica served a prompt: its prefix cache now holds these blocks."""
        self.affinity.remember(replica_id, block_hashes)

    def _scores(self, pool: Sequence[Candidate], block_hashes: Sequence[int]) -> list[tuple[str, float]]:
        if self.policy != "score":  # the other policies rank by in-flight requests only
            return [(c.replica_id, float(c.num_inflight)) for c in pool]
        return [(c.replica_id, self.score(c, block_hashes)) for c in pool]

    def score(self, candidate: Candidate, block_hashes: Sequence[int]) -> float:
        """The ``score`` policy's number for one candidate (lower is better)."""
        matched = self.affinity.num_matched(candidate.replica_id, block_hashes)
        return (load_score(candidate, self.weights)
                - affinity_bonus(matched, len(block_hashes), self.weights))

    def _choose(self, pool: Sequence[Candidate], scores: Sequence[tuple[str, float]]) -> str:
        if self.policy == "round-robin":
            return self._round_robin(pool)
        if self.policy == "power-of-two":
            return self._power_of_two(scores)
        return best(scores)  # score and least-request: the lowest number wins

    def _round_robin(self, pool: Sequence[Candidate]) -> str:
        chosen = pool[self._next % len(pool)].replica_id
        self._next += 1
        return chosen

    def _power_of_two(self, scores: Sequence[tuple[str, float]]) -> str:
        if len(scores) <= 2:
            return best(scores)
        return best(self.rng.sample(list(scores), 2))
