"""Routing on synthetic fleets: filtering, scores, prefix affinity, exclusion and every policy."""

from __future__ import annotations

import random

import pytest

from controlplane.gateway.routing import (
    Candidate,
    PrefixAffinity,
    Router,
    ScoreWeights,
    prompt_block_hashes,
    routable,
)
from controlplane.replicas import ReplicaEndpoint, ReplicaLoad, ReplicaState


def endpoint(replica_id: str, state: ReplicaState = ReplicaState.READY) -> ReplicaEndpoint:
    return ReplicaEndpoint(replica_id=replica_id, zone="az-a", host="127.0.0.1", port=8101, state=state,
                           model="default")


def candidate(replica_id: str, *, waiting: float = 0, kv: float = 0.0, inflight: int = 0,
              state: ReplicaState = ReplicaState.READY, ejected: bool = False) -> Candidate:
    load = ReplicaLoad(replica_id, num_waiting=waiting, num_running=0, kv_cache_usage=kv, observed_at=0.0)
    return Candidate(endpoint(replica_id, state), load, inflight, ejected)


def fleet(n: int = 3) -> list[Candidate]:
    return [candidate(f"r{i}") for i in range(n)]


def test_only_ready_replicas_that_are_not_ejected_are_routable() -> None:
    candidates = [candidate("ready"), candidate("ejected", ejected=True),
                  *(candidate(s.value, state=s) for s in ReplicaState if s is not ReplicaState.READY)]

    assert [c.replica_id for c in routable(candidates)] == ["ready"]
    decision = Router("score").pick(candidates)
    assert decision.replica_id == "ready"
    assert "ejected" in decision.excluded and "draining" in decision.excluded


def test_no_routable_replica_gives_an_unrouted_decision() -> None:
    decision = Router("score").pick([candidate("r0", state=ReplicaState.DRAINING)])

    assert not decision.is_routed and decision.replica_id is None and decision.scores == ()


@pytest.mark.parametrize("loads, expected", [
    ({"r0": {"waiting": 3}, "r1": {"waiting": 1}, "r2": {"waiting": 2}}, "r1"),
    ({"r0": {"kv": 0.9}, "r1": {"kv": 0.5}, "r2": {"kv": 0.1}}, "r2"),
    ({"r0": {"inflight": 2}, "r1": {"inflight": 5}, "r2": {"inflight": 1}}, "r2"),
    ({"r0": {"waiting": 2}, "r1": {"inflight": 1, "kv": 0.1}, "r2": {"kv": 0.6}}, "r1"),
])
def test_score_prefers_the_least_loaded_replica(loads: dict[str, dict[str, float]], expected: str) -> None:
    candidates = [candidate(rid, **kw) for rid, kw in loads.items()]  # type: ignore[arg-type]

    decision = Router("score").pick(candidates)

    assert decision.replica_id == expected
    assert next(s for s, _ in decision.scores) == expected
    assert [score for _, score in decision.scores] == sorted(score for _, score in decision.scores)


def test_score_is_waiting_plus_weighted_kv_plus_inflight() -> None:
    weights = ScoreWeights(waiting=1.0, kv_usage=4.0, inflight=0.5, affinity=2.0)
    router = Router("score", weights=weights)

    assert router.score(candidate("r0", waiting=2, kv=0.5, inflight=4), ()) == pytest.approx(2 + 2 + 2)
    assert router.score(Candidate(endpoint("r1")), ()) == 0.0  # no metrics yet: counts as idle


def test_equal_scores_go_to_the_lowest_replica_id() -> None:
    candidates = [candidate("r2"), candidate("r0"), candidate("r1")]

    assert Router("score").pick(candidates).replica_id == "r0"
    assert Router("least-request").pick(candidates).replica_id == "r0"


def test_a_replica_that_served_the_prefix_gets_the_affinity_bonus() -> None:
    router = Router("score")
    prompt = list(range(64))  # four full blocks of 16
    hashes = prompt_block_hashes(prompt)
    router.remember("r2", hashes)

    decision = router.pick(fleet(), block_hashes=hashes)

    assert len(hashes) == 4
    assert decision.replica_id == "r2" and decision.affinity_blocks == 4
    assert dict(decision.scores)["r2"] == pytest.approx(-ScoreWeights().affinity)


def test_affinity_counts_leading_blocks_only_and_outweighs_a_little_load() -> None:
    router = Router("score")
    shared = list(range(32))
    router.remember("r1", prompt_block_hashes([*shared, *range(100, 132)]))
    other = prompt_block_hashes([*shared, *range(200, 232)])  # same first two blocks, then different

    assert router.affinity.num_matched("r1", other) == 2
    assert router.affinity.num_matched("r0", other) == 0
    assert router.pick([candidate("r0"), candidate("r1", inflight=0)], block_hashes=other).replica_id == "r1"
    busy = [candidate("r0"), candidate("r1", waiting=5)]
    assert router.pick(busy, block_hashes=other).replica_id == "r0"  # affinity is a bonus, not a pin


def test_affinity_forgets_the_least_recently_used_blocks() -> None:
    affinity = PrefixAffinity(capacity_per_replica=4)
    first = prompt_block_hashes(list(range(64)))
    second = prompt_block_hashes(list(range(1000, 1064)))

    affinity.remember("r0", first)
    affinity.remember("r0", second)

    assert affinity.num_matched("r0", second) == 4
    assert affinity.num_matched("r0", first) == 0
    affinity.forget("r0")
    assert affinity.num_matched("r0", second) == 0


def test_prompts_shorter_than_a_block_have_no_affinity() -> None:
    assert prompt_block_hashes(list(range(15))) == []
    assert Router("score").pick(fleet(), block_hashes=[]).affinity_blocks == 0


@pytest.mark.parametrize("policy", ["score", "round-robin", "least-request", "power-of-two"])
def test_replicas_already_tried_are_excluded(policy: str) -> None:
    router = Router(policy, rng=random.Random(0))

    for _ in range(10):
        decision = router.pick(fleet(), exclude={"r0", "r2"})
        assert decision.replica_id == "r1"
    assert not router.pick(fleet(), exclude={"r0", "r1", "r2"}).is_routed


def test_round_robin_cycles_in_replica_id_order() -> None:
    router = Router("round-robin")
    candidates = [candidate("r2", waiting=100), candidate("r0"), candidate("r1")]

    picks = [router.pick(candidates).replica_id for _ in range(6)]

    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_least_request_picks_the_fewest_in_flight_and_ignores_queue_metrics() -> None:
    candidates = [candidate("r0", inflight=3), candidate("r1", inflight=1, waiting=50, kv=1.0),
                  candidate("r2", inflight=2)]

    assert Router("least-request").pick(candidates).replica_id == "r1"


def test_power_of_two_is_deterministic_with_a_seeded_rng() -> None:
    candidates = [candidate(f"r{i}", inflight=i) for i in range(6)]

    runs = []
    for _ in range(2):
        router = Router("power-of-two", rng=random.Random(42))
        runs.append([router.pick(candidates).replica_id for _ in range(20)])

    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # random pairs, not always the global minimum
    assert "r5" not in runs[0]  # the most loaded replica never wins a pair


def test_power_of_two_takes_the_less_loaded_of_its_two_samples() -> None:
    candidates = [candidate(f"r{i}", inflight=10 * i) for i in range(5)]
    rng = random.Random(7)
    router = Router("power-of-two", rng=random.Random(7))

    for _ in range(20):
        pair = rng.sample([(c.replica_id, float(c.num_inflight)) for c in candidates], 2)
        assert router.pick(candidates).replica_id == min(pair, key=lambda p: (p[1], p[0]))[0]


def test_power_of_two_with_two_replicas_is_least_request() -> None:
    candidates = [candidate("r0", inflight=4), candidate("r1", inflight=2)]

    assert {Router("power-of-two").pick(candidates).replica_id for _ in range(10)} == {"r1"}


def test_unknown_policy_and_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        Router("fastest")
    with pytest.raises(ValueError, match="num_inflight"):
        Candidate(endpoint("r0"), num_inflight=-1)
    with pytest.raises(ValueError, match="affinity"):
        ScoreWeights(affinity=-1)
    with pytest.raises(ValueError, match="capacity"):
        PrefixAffinity(capacity_per_replica=0)
