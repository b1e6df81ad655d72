"""Engine responses that waited for a slow client, merged (`convert.merged_scheduler_output`) and
run through the output pipeline once, against the same responses one at a time (what a client
that keeps up gets): the same text, ids, logprobs, finish reason and usage, cut at the same
token when a stop string completes, on the embedded model's real tokenizer."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from protos.llmserve.v1 import logprobs_pb2, scheduler_pb2
from services.tokenizer.output import OutputPipeline, OutputText, SchedulerOutput, TokenLogprob
from services.tokenizer.routing import scheduler_convert as convert
from tests.unit.test_detokenizer import (
    BROKEN_BYTE_TOKEN_IDS,
    BYTE_TOKEN_IDS,
    MODEL_TOKENIZER,
    NON_ASCII_BYTE_TOKEN_IDS,
    TOKENIZER,
    VOCAB_SIZE,
    CountingTokenizer,
)

PROMPT_IDS = MODEL_TOKENIZER.encode("Answer briefly:")
CORPUS = (
    "The quick brown fox 🦊 jumps over the lazy dog. 日本語のテキスト, café! "
    "def add(a, b):\n    return a + b\n\nUser: thanks </answer> 👨‍👩‍👧 done. "
)
CORPUS_IDS = sorted(set(MODEL_TOKENIZER.encode(CORPUS)))


@dataclass(frozen=True, slots=True)
class Received:
    """What a client got, joined over its messages."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str
    completion_tokens: int
    num_messages: int


def one_token_responses(
    token_ids: Sequence[int], finish_reason: str = "length"
) -> list[scheduler_pb2.SubmitResponse]:
    """The Submit stream of a reader that keeps up: one id per message, a logprob each, the
    queue time on the first message, the finish reason on the last."""
    responses = [
        scheduler_pb2.SubmitResponse(
            token_ids=[token_id],
            logprobs=[logprobs_pb2.TokenLogprob(token_id=token_id, logprob=-float(index))],
            queue_ms=5.0 if index == 0 else 0.0,
            num_prompt_tokens=len(PROMPT_IDS),
        )
        for index, token_id in enumerate(token_ids)
    ] or [scheduler_pb2.SubmitResponse()]
    responses[-1].finish_reason = finish_reason
    return responses


def one_at_a_time(responses: Sequence[scheduler_pb2.SubmitResponse]) -> list[SchedulerOutput]:
    return [convert.scheduler_output(r) for r in responses]


def merged(
    responses: Sequence[scheduler_pb2.SubmitResponse], sizes: Sequence[int]
) -> list[SchedulerOutput]:
    """Consecutive responses merged in groups of the given sizes (cycled)."""
    groups = []
    start = 0
    for size in itertools.cycle(sizes):
        if start >= len(responses):
            return groups
        groups.append(convert.merged_scheduler_output(responses[start : start + size]))
        start += size
    raise AssertionError("unreachable")


def reference_merge(outputs: Sequence[SchedulerOutput]) -> SchedulerOutput:
    """The merge rule spelled out: what one-at-a-time reading ends up with."""
    return SchedulerOutput(
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        logprobs=tuple(p for o in outputs for p in o.logprobs),
        finish_reason=outputs[-1].finish_reason,
        queue_ms=next((o.queue_ms for o in reversed(outputs) if o.queue_ms), 0.0),
        num_cached_tokens=next(
            (o.num_cached_tokens for o in reversed(outputs) if o.num_cached_tokens), 0
        ),
        num_prompt_tokens=next(
            (o.num_prompt_tokens for o in reversed(outputs) if o.num_prompt_tokens), 0
        ),
    )


def receive(
    outputs: Sequence[SchedulerOutput], stop: Sequence[str], tokenizer: object = TOKENIZER
) -> Received:
    pipeline = OutputPipeline.create(tokenizer, PROMPT_IDS, stop, 0.0)
    deltas = []
    for now_s, output in enumerate(outputs, start=1):
        delta = pipeline.step(output, float(now_s))
        if delta is not None:
            deltas.append(delta)
            if delta.finish_reason:
                break
    last = deltas[-1] if deltas else None
    return Received(
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        logprobs=[p for d in deltas for p in d.logprobs],
        finish_reason=last.finish_reason if last else "",
        completion_tokens=last.usage.completion_tokens if last and last.usage else -1,
        num_messages=len(deltas),
    )


def check_same_as_one_at_a_time(
    token_ids: Sequence[int], stop: Sequence[str], sizes: Sequence[int]
) -> Received:
    responses = one_token_responses(token_ids)
    expected = receive(one_at_a_time(responses), stop)
    got = receive(merged(responses, sizes), stop)
    assert got.text == expected.text
    assert got.token_ids == expected.token_ids
    assert got.logprobs == expected.logprobs
    assert got.finish_reason == expected.finish_reason
    assert got.completion_tokens == expected.completion_tokens == len(expected.token_ids)
    return got


# ---- merging responses ---------------------------------------------------------------------


def test_merge_joins_ids_and_logprobs_and_keeps_the_last_finish() -> None:
    merged_output = convert.merged_scheduler_output(one_token_responses([11, 12, 13], "stop"))
    assert merged_output.token_ids == (11, 12, 13)
    assert [p.token_id for p in merged_output.logprobs] == [11, 12, 13]
    assert merged_output.finish_reason == "stop"
    # queue_ms comes on the first message only; a counter not reported later is kept.
    assert merged_output.queue_ms == 5.0
    assert merged_output.num_prompt_tokens == len(PROMPT_IDS)


def test_merge_keeps_the_last_reported_counter() -> None:
    responses = [
        scheduler_pb2.SubmitResponse(token_ids=[1], num_cached_tokens=16),
        scheduler_pb2.SubmitResponse(token_ids=[2], num_cached_tokens=32),
        scheduler_pb2.SubmitResponse(token_ids=[3]),
    ]
    assert convert.merged_scheduler_output(responses).num_cached_tokens == 32


def test_merge_leaves_the_responses_alone() -> None:
    responses = one_token_responses([1, 2])
    convert.merged_scheduler_output(responses)
    assert [list(r.token_ids) for r in responses] == [[1], [2]]


_counter = st.sampled_from([0, 0, 3, 17])
_responses = st.lists(
    st.builds(
        scheduler_pb2.SubmitResponse,
        token_ids=st.lists(st.integers(0, 100), max_size=3),
        queue_ms=st.sampled_from([0.0, 0.0, 2.5]),
        num_cached_tokens=_counter,
        num_prompt_tokens=_counter,
    ),
    min_size=1,
    max_size=6,
)


@given(responses=_responses, finish_reason=st.sampled_from(["", "length", "stop"]))
def test_merge_is_the_one_at_a_time_rule(
    responses: list[scheduler_pb2.SubmitResponse], finish_reason: str
) -> None:
    # Only a stream's last message finishes it (a batch never goes past a finished one).
    responses[-1].finish_reason = finish_reason
    assert convert.merged_scheduler_output(responses) == reference_merge(one_at_a_time(responses))


# ---- stop strings inside and across merged outputs ------------------------------------------


def test_stop_in_the_middle_of_a_merged_output_cuts_ids_and_logprobs_there() -> None:
    token_ids = MODEL_TOKENIZER.encode("Hello there, my friend. More text that must not appear.")
    got = check_same_as_one_at_a_time(token_ids, ["my fri"], [len(token_ids)])
    assert got.text == "Hello there, " and got.finish_reason == "stop"
    # Sent up to and including the token that completed the stop, not one more.
    stop_end = len(MODEL_TOKENIZER.decode(got.token_ids[:-1]))
    assert stop_end < len("Hello there, my fri")
    assert len(got.token_ids) < len(token_ids) and got.num_messages == 1


def test_stop_straddling_two_merged_outputs() -> None:
    token_ids = MODEL_TOKENIZER.encode("one two three four five six seven")
    for size in range(1, len(token_ids) + 1):
        got = check_same_as_one_at_a_time(token_ids, ["three four"], [size])
        assert got.text == "one two " and got.finish_reason == "stop"


def test_stop_in_the_text_flushed_at_the_end() -> None:
    # "🦊" is held back until it completes; with the stream's end in the same merged output
    # the stop matches in the flush, after every id was sent.
    token_ids = MODEL_TOKENIZER.encode("run 🦊")
    for size in (1, 2, len(token_ids)):
        got = check_same_as_one_at_a_time(token_ids, ["🦊"], [size])
        assert got.text == "run " and got.finish_reason == "stop"


def test_a_clean_merged_output_is_detokenized_in_one_window() -> None:
    counting = CountingTokenizer(TOKENIZER)
    output = OutputText(counting, PROMPT_IDS, ["</answer>"])
    counting.window_sizes.clear()
    step = output.add(MODEL_TOKENIZER.encode(" and the lazy dog sleeps"))
    assert step.text and not step.stopped
    assert len(counting.window_sizes) == 2  # the held-back text and the new text, once


# ---- random inputs ----------------------------------------------------------------------------

_token_ids = st.one_of(
    st.sampled_from(CORPUS_IDS),
    st.integers(min_value=0, max_value=VOCAB_SIZE - 1),
    st.sampled_from(BYTE_TOKEN_IDS),
)
_sizes = st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=6)


@st.composite
def _stops_for(draw: st.DrawFn, token_ids: Sequence[int]) -> list[str]:
    """Stop strings that often match: pieces of the output's own text, plus random ones."""
    text = TOKENIZER.decode(list(token_ids))
    stops = []
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        if text and draw(st.booleans()):
            start = draw(st.integers(min_value=0, max_value=len(text) - 1))
            stops.append(text[start : start + draw(st.integers(min_value=1, max_value=6))])
        else:
            stops.append(draw(st.sampled_from(["</answer>", "\n\n", "e", "🦊", "\ufffd", "日本"])))
    return stops


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), token_ids=st.lists(_token_ids, max_size=60), sizes=_sizes)
def test_random_ids_merged_equal_one_at_a_time(
    data: st.DataObject, token_ids: list[int], sizes: list[int]
) -> None:
    check_same_as_one_at_a_time(token_ids, data.draw(_stops_for(token_ids)), sizes)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    token_ids=st.lists(
        st.one_of(
            st.sampled_from(BROKEN_BYTE_TOKEN_IDS),
            st.sampled_from(NON_ASCII_BYTE_TOKEN_IDS),
            st.sampled_from(CORPUS_IDS),
        ),
        min_size=20,
        max_size=100,
    ),
    sizes=_sizes,
)
def test_runs_of_broken_bytes_merged_equal_one_at_a_time(
    data: st.DataObject, token_ids: list[int], sizes: list[int]
) -> None:
    # Long runs of text ending in U+FFFD: the detokenizer holds ids back (and force-splits
    # past its limit), the case where a chunk's text differs from one id at a time's.
    check_same_as_one_at_a_time(token_ids, data.draw(_stops_for(token_ids)), sizes)


def test_tokenizer_fixture_is_the_embedded_one() -> None:
    assert isinstance(TOKENIZER, Tokenizer) and VOCAB_SIZE > 40_000
