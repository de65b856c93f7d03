"""Unit tests for inference.output.TextAssembler: streaming text with stop strings held back."""

from __future__ import annotations

import itertools

import pytest

from inference.output import TextAssembler


def stream(stop: tuple[str, ...], pieces: list[str]) -> tuple[list[str], bool, str]:
    """Push every piece, then flush; returns (the deltas a client would see, stopped, flushed tail)."""
    assembler = TextAssembler(stop)
    deltas, stopped = [], False
    for piece in pieces:
        delta, stopped = assembler.push(piece)
        deltas.append(delta)
    return deltas, stopped, assembler.flush()


def splits(text: str, num_pieces: int) -> list[list[str]]:
    """Every way to cut ``text`` into ``num_pieces`` non-empty pieces."""
    result = []
    for cuts in itertools.combinations(range(1, len(text)), num_pieces - 1):
        bounds = (0, *cuts, len(text))
        result.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return result


def test_without_stop_strings_every_piece_is_emitted_at_once() -> None:
    deltas, stopped, tail = stream((), ["Hel", "lo", " world"])

    assert deltas == ["Hel", "lo", " world"]
    assert not stopped and tail == ""


def test_stop_string_inside_one_piece_cuts_the_text_before_it() -> None:
    assembler = TextAssembler(("END",))

    delta, stopped = assembler.push("done END more")

    assert (delta, stopped) == ("done ", True)
    assert assembler.text == "done "


@pytest.mark.parametrize("pieces", splits("say STOP now", 3) + splits("say STOP now", 4)[::7])
def test_stop_string_split_across_tokens_is_never_emitted(pieces: list[str]) -> None:
    deltas, stopped, tail = stream(("STOP",), pieces)

    assert stopped
    assert "".join(deltas) + tail == "say "


def test_text_that_only_looks_like_a_stop_prefix_is_held_then_released() -> None:
    assembler = TextAssembler(("END",))

    first = assembler.push("the EN")
    second = assembler.push("D")

    assert first == ("the ", False)  # "EN" may start "END": held back
    assert second == ("", True)


def test_held_back_partial_match_is_released_once_it_cannot_match() -> None:
    deltas, stopped, tail = stream(("END",), ["the EN", "VOY"])

    assert deltas == ["the ", "ENV"]
    assert not stopped and tail == "OY"


def test_held_back_text_is_released_at_flush() -> None:
    assembler = TextAssembler(("STOP",))

    delta, stopped = assembler.push("hello")
    tail = assembler.flush()

    assert (delta, stopped) == ("he", False)
    assert tail == "llo"
    assert assembler.flush() == ""


def test_all_text_is_emitted_exactly_once_when_no_stop_matches() -> None:
    text = "a quick brown fox jumps"
    for pieces in splits(text, 3)[::5]:
        deltas, stopped, tail = stream(("STOP", "xyz"), pieces)

        assert not stopped
        assert "".join(deltas) + tail == text


@pytest.mark.parametrize(("stop", "expected"), [
    (("world", "o w"), "hell"),  # "o w" starts first
    (("o w", "world"), "hell"),  # order of the stop list does not matter
    (("lo w", "w"), "hel"),  # a longer stop string that starts first wins over a shorter later one
    (("and", "wor"), "hello "),
])
def test_earliest_of_several_stop_strings_wins(stop: tuple[str, ...], expected: str) -> None:
    deltas, stopped, tail = stream(stop, ["hello world and more"])

    assert stopped
    assert "".join(deltas) + tail == expected


@pytest.mark.parametrize("pieces", splits("xabcd!", 3))
def test_earliest_stop_wins_when_matches_overlap_across_tokens(pieces: list[str]) -> None:
    deltas, stopped, tail = stream(("bcd", "abc"), pieces)

    assert stopped
    assert "".join(deltas) + tail == "x"


def test_nothing_is_emitted_after_a_stop() -> None:
    assembler = TextAssembler(("!",))
    assembler.push("hi!")

    assert assembler.push("more") == ("", True)
    assert assembler.flush() == ""
    assert assembler.text == "hi"


def test_empty_piece_emits_nothing() -> None:
    assembler = TextAssembler(("END",))

    assert assembler.push("") == ("", False)
    assert assembler.text == ""
