"""Traffic slices: a version's share of requests is its weight whatever its replica count, a conversation
stays on one version, colours cut across versions, and each slice keeps what it saw."""

from __future__ import annotations

import pytest

from controlplane.gateway.slices import (
    STABLE,
    Assignment,
    Outcome,
    Share,
    SlicePlan,
    SliceSamples,
    assign,
    conversation_key,
)


def _shares(plan: SlicePlan, n: int = 20_000) -> tuple[dict[str, float], dict[str | None, float]]:
    versions: dict[str, float] = {}
    colours: dict[str | None, float] = {}
    for i in range(n):
        a = assign(plan, f"request:{i}")
        versions[a.version] = versions.get(a.version, 0) + 1 / n
        colours[a.colour] = colours.get(a.colour, 0) + 1 / n
    return versions, colours


def test_each_version_gets_its_share_and_the_rest_stays_stable() -> None:
    plan = SlicePlan(split=(Share("v2", 0.05),))
    versions, colours = _shares(plan)
    assert versions["v2"] == pytest.approx(0.05, abs=0.006)
    assert versions[STABLE] == pytest.approx(0.95, abs=0.006)
    assert colours == {None: pytest.approx(1.0)}
    assert plan.share_of(STABLE) == pytest.approx(0.95)


def test_colours_cut_across_versions_independently() -> None:
    plan = SlicePlan(split=(Share("v2", 0.5),), colours=(Share("chaos", 0.1), Share("control", 0.1)))
    n = 20_000
    both = sum(1 for i in range(n) if (a := assign(plan, f"k{i}")).version == "v2" and a.colour == "chaos")
    _, colours = _shares(plan, n)
    assert colours["chaos"] == pytest.approx(0.1, abs=0.01)
    assert colours["control"] == pytest.approx(0.1, abs=0.01)
    assert both / n == pytest.approx(0.05, abs=0.008)  # independent: 0.5 x 0.1


def test_a_conversation_keeps_its_version_as_it_grows() -> None:
    plan = SlicePlan(split=(Share("v2", 0.3),))
    first_turn = conversation_key({}, [111], "a")
    later_turn = conversation_key({}, [111, 222, 333], "b")  # the same first block: the same conversation
    assert assign(plan, first_turn) == assign(plan, later_turn)
    assert conversation_key({"x-session-id": "s1"}, [111], "a") == "session:s1"
    assert conversation_key({}, [], "r9") == "request:r9"


def test_raising_a_share_only_moves_conversations_onto_the_new_version() -> None:
    """Shares grow from the bottom of [0, 1): a step from 5% to 20% keeps the 5% where they were."""
    small, large = SlicePlan(split=(Share("v2", 0.05),)), SlicePlan(split=(Share("v2", 0.2),))
    keys = [f"k{i}" for i in range(5_000)]
    assert all(assign(large, k).version == "v2" for k in keys if assign(small, k).version == "v2")


def test_assignment_headers_name_the_colour_for_the_replica() -> None:
    assert Assignment().upstream_headers() == {}
    headers = Assignment("v2", "chaos").upstream_headers()
    assert headers == {"x-llmsre-colour": "chaos", "baggage": "llmsre.colour=chaos"}
    assert Assignment("v2", "chaos").slices() == ["version:v2", "colour:chaos"]
    assert Assignment().slices() == ["version:stable"]


@pytest.mark.parametrize(("raw", "message"), [
    ({"split": {"v2": 0.7, "v3": 0.4}}, "add up to more than 1"),
    ({"split": {"v2": 1.5}}, "must be in [0, 1]"),
    ({"split": {"Bad Name": 0.1}}, "name"),
    ({"colours": {"chaos.1": 0.1}}, "colour 'chaos.1'"),
])
def test_a_bad_plan_is_refused(raw: dict[str, dict[str, float]], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SlicePlan.from_json(raw)


def test_plan_round_trips_through_json() -> None:
    plan = SlicePlan(split=(Share("v2", 0.2),), colours=(Share("chaos", 0.1),))
    assert SlicePlan.from_json(plan.to_json()) == plan
    assert SlicePlan.from_json(None) == SlicePlan()


def test_samples_are_kept_per_slice_bounded_and_read_since_a_time() -> None:
    samples = SliceSamples(capacity=3)
    for i in range(5):
        samples.record(Assignment("v2", "chaos"), Outcome(float(i), i % 2 == 0, 0.1 * i, 0.01))
    samples.record(Assignment(), Outcome(10.0, False, None, None))
    recent = samples.since(3.0)
    assert [o.at for o in recent["version:v2"]] == [3.0, 4.0]
    assert [o.at for o in recent["colour:chaos"]] == [3.0, 4.0]
    assert [o.ok for o in recent["version:stable"]] == [False]
    assert len(samples.since(0.0)["version:v2"]) == 3  # bounded
    raw = samples.to_json(4.0)
    assert [Outcome.from_json(r) for r in raw["version:v2"]] == [Outcome(4.0, True, 0.4, 0.01)]
