"""The reasoning splitter: `<think>` text apart from the answer, the same however the output is
cut into deltas, and never half a tag in either part."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.text.reasoning import ReasoningSplitter, SplitDelta, split_reasoning


def streamed(parser: str, pieces: list[str]) -> SplitDelta:
    splitter = ReasoningSplitter(parser)
    reasoning, content = [], []
    for piece in pieces:
        delta = splitter.feed(piece)
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    last = splitter.finish()
    return SplitDelta("".join(reasoning) + last.reasoning, "".join(content) + last.content)


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>\nadd them\n</think>\n\n4", "\nadd them\n", "4"),
        ("qwen3", "4, without thinking", "", "4, without thinking"),
        ("qwen3", "  <think>a</think>b", "a", "b"),
        ("qwen3", "<think>still thinking when cut", "still thinking when cut", ""),
        ("qwen3", "a <think> in the answer", "", "a <think> in the answer"),
        ("deepseek_r1", "add them\n</think>\n\n4", "add them\n", "4"),
        ("deepseek_r1", "<think>add them</think>4", "add them", "4"),
        ("deepseek_r1", "cut off mid-thought", "cut off mid-thought", ""),
        ("deepseek_r1", "a</think>b </think> c", "a", "b </think> c"),
    ],
)
def test_whole_outputs_split(parser: str, text: str, reasoning: str, content: str) -> None:
    assert split_reasoning(parser, text) == SplitDelta(reasoning, content)


TEXTS = st.text(alphabet="ab<>/thinkT \n", max_size=40).map(
    lambda s: s.replace("T", "</think>")
) | st.builds(lambda a, b: f"<think>{a}</think>{b}", st.text(max_size=15), st.text(max_size=15))


@given(
    parser=st.sampled_from(["qwen3", "deepseek_r1"]),
    text=TEXTS,
    cuts=st.lists(st.integers(0, 60), max_size=8),
)
def test_any_cut_into_deltas_gives_the_whole_split(parser: str, text: str, cuts: list[int]) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert streamed(parser, pieces) == split_reasoning(parser, text)


def test_a_tag_split_across_deltas_is_never_shown_in_part() -> None:
    splitter = ReasoningSplitter("qwen3")
    out = [splitter.feed(piece) for piece in ["<th", "ink>ok</", "thi", "nk>", "yes"]]
    assert [d.reasoning for d in out] == ["", "ok", "", "", ""]
    assert [d.content for d in out] == ["", "", "", "", "yes"]
    assert not splitter.in_reasoning


def test_an_unknown_parser_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningSplitter("r2")
