"""Selectors: ALL, COUNT(n), PERCENT(n) over filtered targets, resolved deterministically."""

from __future__ import annotations

import pytest

from chaos.targets import Selector

from .fakes import FakeTarget, fleet


def ids(targets: tuple[object, ...]) -> list[str]:
    return [t.replica_id for t in targets]  # type: ignore[attr-defined]


def test_all_picks_every_matching_target_sorted_by_id() -> None:
    assert ids(Selector.parse("ALL").resolve(fleet(3)[::-1])) == ["r0", "r1", "r2"]


def test_filters_by_replica_id_zone_and_label() -> None:
    targets = [FakeTarget("a", zone="az-a", labels=(("tier", "gold"),)), FakeTarget("b", zone="az-b"),
               FakeTarget("c", zone="az-a")]
    assert ids(Selector.parse("ALL", zones=["az-a"]).resolve(targets)) == ["a", "c"]
    assert ids(Selector.parse("ALL", replica_ids=["b", "c"]).resolve(targets)) == ["b", "c"]
    assert ids(Selector.parse("all", labels={"tier": "gold"}).resolve(targets)) == ["a"]


def test_seeded_count_and_percent_choose_the_same_targets_every_time() -> None:
    targets = fleet(10)
    first = Selector.parse("COUNT(3)", seed=7).resolve(targets)
    assert len(first) == 3
    assert all(Selector.parse("COUNT(3)", seed=7).resolve(targets[::-1]) == first for _ in range(5))
    assert len(Selector.parse("PERCENT(25)", seed=1).resolve(targets)) == 3  # rounds up
    assert len(Selector.parse("PERCENT(1)", seed=1).resolve(targets)) == 1


@pytest.mark.parametrize("text, message", [
    ("SOME", "expected ALL, COUNT"), ("COUNT(0)", "COUNT\\(n\\) needs a whole n >= 1"),
    ("PERCENT(0)", "0 < n <= 100"), ("PERCENT(150)", "0 < n <= 100"), ("COUNT(-1)", "expected ALL"),
])
def test_bad_selector_text_is_refused_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Selector.parse(text)


def test_selector_that_cannot_be_met_is_refused() -> None:
    with pytest.raises(ValueError, match="wants 5 targets, only 3 match"):
        Selector.parse("COUNT(5)").resolve(fleet(3))
    with pytest.raises(ValueError, match="matches none of 3 targets"):
        Selector.parse("ALL", zones=["mars"]).resolve(fleet(3))
