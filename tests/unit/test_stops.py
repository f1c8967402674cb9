"""Stop-sequence matching with hold-back."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from mlxd.protocol.stops import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    out.append(m.flush())
    return out, m.is_stopped


def test_stop_inside_one_piece_cuts_there() -> None:
    out, stopped = run(["END"], ["hello END world"])
    assert "".join(out) == "hello "
    assert stopped


def test_stop_split_across_pieces_is_held_back() -> None:
    m = StopMatcher(["</s>"])
    assert m.feed("abc<") == "abc"
    assert m.feed("/") == ""
    assert m.feed("s>tail") == ""
    assert m.is_stopped
    assert m.flush() == ""


def test_false_alarm_is_released() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ""
    assert m.feed("ART") == "START"
    assert m.feed("S") == ""
    assert m.flush() == "S"
    assert not m.is_stopped


def test_earliest_of_several_stops_wins() -> None:
    out, stopped = run(["world", "lo"], ["hello world"])
    assert "".join(out) == "hel"
    assert stopped


def test_the_stop_complete_first_wins_even_if_another_started_earlier() -> None:
    # Found by the property test below: "axa" is a stop that starts first, but "x" is complete
    # first, and token by token generation would have stopped there.
    for pieces in (["axa"], ["ax", "a"], ["a", "x", "a"]):
        out, stopped = run(["x", "axa"], pieces)
        assert "".join(out) == "a" and stopped, pieces


def test_no_stops_passes_everything() -> None:
    out, stopped = run([], ["a", "b", ""])
    assert "".join(out) == "ab"
    assert not stopped


def test_nothing_after_a_stop() -> None:
    m = StopMatcher(["x"])
    m.feed("axb")
    assert m.feed("more") == ""


alphabet = st.text(alphabet="abcx\n🙂", max_size=30)


@given(text=alphabet, stops=st.lists(st.text(alphabet="abcx\n🙂", min_size=1, max_size=4), max_size=3), cuts=st.lists(st.integers(0, 30), max_size=8))
def test_matches_the_whole_text_answer_however_it_is_split(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in pairwise(bounds)]
    out, stopped = run(stops, pieces)
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]  # (end, start)
    expected = text[: min(hits)[1]] if hits else text  # the stop complete first wins
    assert "".join(out) == expected
    assert stopped == bool(hits)
    emitted = ""
    for part in out:
        emitted += part
        assert not any(s in emitted for s in stops)


def test_the_matcher_names_the_stop_string_that_ended_the_text() -> None:
    m = StopMatcher(["x", "axa", "never"])
    assert m.matched is None
    m.feed("a")
    m.feed("xa")  # "x" completes before "axa" could
    assert m.is_stopped and m.matched == "x"
    free = StopMatcher(["END"])
    free.feed("no stop here")
    assert free.matched is None
