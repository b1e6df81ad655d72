"""Stop strings over text deltas, checked against a naive `str.find` over the whole text."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.text.stop_strings import StopResult, StopStringMatcher


def reference(
    text: str, stop_strings: Sequence[str], *, include_stop: bool = False
) -> tuple[str, str | None]:
    """The output the whole text should give: cut at the first stop to complete."""
    best: tuple[int, int, str] | None = None
    for stop in stop_strings:
        start = text.find(stop)
        if start < 0:
            continue
        # The earliest end wins; at equal ends the earliest start (the longer stop).
        candidate = (start + len(stop), start, stop)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return text, None
    end, start, stop = best
    return text[: end if include_stop else start], stop


def run(
    deltas: Sequence[str], stop_strings: Sequence[str], *, include_stop: bool = False
) -> tuple[str, str | None, list[StopResult]]:
    """Feeds the deltas as a server would; returns the emitted text, the stop, the results."""
    matcher = StopStringMatcher(stop_strings, include_stop_str_in_output=include_stop)
    results: list[StopResult] = []
    for delta in deltas:
        results.append(matcher.feed(delta))
        if results[-1].stopped:
            return "".join(r.text for r in results), results[-1].stop, results
    emitted = "".join(r.text for r in results) + matcher.flush()
    return emitted, None, results


def split_at(text: str, cuts: Sequence[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("cut", range(1, len("hello </s> world")))
def test_stop_split_at_every_position_is_caught_and_never_emitted(cut: int) -> None:
    text = "hello </s> world"
    emitted, stop, results = run([text[:cut], text[cut:]], ["</s>"])
    assert (emitted, stop) == ("hello ", "</s>")
    assert all("<" not in r.text for r in results)


@pytest.mark.parametrize("cut", range(1, len("ab</s>cd")))
@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_split_into_single_characters_after_a_cut(cut: int, include_stop: bool) -> None:
    text = "ab</s>cd"
    deltas = [text[:cut], *text[cut:]]
    emitted, stop, _ = run(deltas, ["</s>"], include_stop=include_stop)
    assert stop == "</s>"
    assert emitted == ("ab</s>" if include_stop else "ab")


def test_overlapping_stops_first_to_complete_wins() -> None:
    # "ab" completes before "abc" could: a streaming reader would already have stopped.
    assert run(["xabcx"], ["abc", "ab"])[:2] == ("x", "ab")
    assert run(["x", "a", "b", "c"], ["abc", "ab"])[:2] == ("x", "ab")


def test_stops_ending_at_the_same_place_prefer_the_earliest_start() -> None:
    assert run(["xabc"], ["bc", "abc"])[:2] == ("x", "abc")
    assert run(["xa", "bc"], ["bc", "abc"])[:2] == ("x", "abc")
    assert run(["xabc"], ["bc", "abc"], include_stop=True)[:2] == ("xabc", "abc")


def test_prefix_of_a_stop_is_held_then_released_by_later_text() -> None:
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("a </") == StopResult("a ")
    assert matcher.held_text == "</"
    assert matcher.feed("b") == StopResult("</b")
    assert matcher.held_text == ""
    assert matcher.flush() == ""


def test_prefix_of_a_stop_is_released_by_flush() -> None:
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("a </").text == "a "
    assert matcher.flush() == "</"
    assert not matcher.stopped


def test_partial_match_restarts_inside_the_held_text() -> None:
    # "aab" fails on the second "a" of "aaab" but the stop starts right there.
    assert run(["a", "a", "a", "b", "c"], ["aab"])[:2] == ("a", "aab")
    assert run(["xababac"], ["abac"])[:2] == ("xab", "abac")


def test_no_stop_emits_everything() -> None:
    deltas = ["The", " quick", " brown", " fox <", "/"]
    emitted, stop, _ = run(deltas, ["</s>", "STOP"])
    assert (emitted, stop) == ("".join(deltas), None)


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == StopResult("anything")
    assert matcher.flush() == ""


def test_multiple_stops_earliest_occurrence_wins() -> None:
    assert run(["one. two! three?"], ["?", "!", "."])[:2] == ("one", ".")
    assert run(["one", " two! three. "], ["?", ".", "!"])[:2] == ("one two", "!")


def test_unicode_stops() -> None:
    assert run(["こんにちは。", "さようなら"], ["。"])[:2] == ("こんにちは", "。")
    assert run(["go 🛑", " now"], ["🛑"])[:2] == ("go ", "🛑")
    assert run(["café", " fin", "i"], ["fini", "é f"])[:2] == ("caf", "é f")
    assert run(["ende: 終", "わり!"], ["終わり"])[:2] == ("ende: ", "終わり")


def test_stop_in_the_very_first_delta() -> None:
    assert run(["STOP and more"], ["STOP"])[:2] == ("", "STOP")
    assert run(["STOP and more"], ["STOP"], include_stop=True)[:2] == ("STOP", "STOP")


def test_include_stop_str_in_output_emits_the_stop_and_drops_what_follows() -> None:
    emitted, stop, results = run(["hello </", "s> world"], ["</s>"], include_stop=True)
    assert (emitted, stop) == ("hello </s>", "</s>")
    assert results[-1] == StopResult("</s>", stopped=True, stop="</s>")


def test_feed_after_stop_emits_nothing() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("abxcd") == StopResult("ab", stopped=True, stop="x")
    assert matcher.feed("more") == StopResult("", stopped=True, stop="x")
    assert matcher.flush() == ""
    assert matcher.stopped and matcher.stop == "x"


def test_empty_deltas_change_nothing() -> None:
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("") == StopResult("")
    assert matcher.feed("a<") == StopResult("a")
    assert matcher.feed("") == StopResult("")
    assert matcher.held_text == "<"


def test_a_copy_goes_on_independently() -> None:
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("text </") == StopResult("text ")
    copy = matcher.copy()
    assert copy.feed("s> more") == StopResult("", stopped=True, stop="</s>")
    assert matcher.held_text == "</" and not matcher.stopped
    assert matcher.feed("x") == StopResult("</x")


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_held_text_never_reaches_the_longest_stop() -> None:
    stops = ["abcd", "bcx", "ccc"]
    matcher = StopStringMatcher(stops)
    for char in "abcabcbcabcc" * 50:
        assert not matcher.feed(char).stopped
        assert len(matcher.held_text) < max(map(len, stops))


# A small alphabet so that random stops actually occur in random text.
_ALPHABET = "ab c€😀"
_texts = st.text(alphabet=_ALPHABET, max_size=40)
_stops = st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=4), max_size=4)


@settings(max_examples=400, deadline=None)
@given(
    text=_texts,
    stop_strings=_stops,
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    include_stop=st.booleans(),
)
def test_matches_the_naive_reference_for_any_split(
    text: str, stop_strings: list[str], cuts: list[int], include_stop: bool
) -> None:
    deltas = split_at(text, [c for c in cuts if c <= len(text)])
    emitted, stop, results = run(deltas, stop_strings, include_stop=include_stop)
    assert (emitted, stop) == reference(text, stop_strings, include_stop=include_stop)
    # Only the last result may say stopped.
    assert all(not r.stopped for r in results[:-1])
