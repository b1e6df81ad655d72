"""The tokenizer tier's pure output pipeline (engine events → public deltas), without gRPC,
on the embedded model's real tokenizer. test_tokenizer_server.py covers the same paths
through the servicer."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.common.model_source import embedded_model_path
from services.contracts.errors import ModelLoadError
from services.contracts.usage import Usage
from services.text.model_tokenizer import ModelTokenizer
from services.tokenizer.output import (
    OutputDelta,
    OutputPipeline,
    OutputText,
    SchedulerOutput,
    TokenLogprob,
)

MIXED_TEXT = "The quick brown fox 🦊 jumps over the lazy dog. 日本語のテキスト, café! 👨‍👩‍👧 done"


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    try:
        return ModelTokenizer.from_path(embedded_model_path())
    except ModelLoadError as error:  # pragma: no cover - the package is a test dependency
        pytest.skip(str(error))


def events_for(
    token_ids: Sequence[int], *, chunk: int = 1, finish_reason: str = "length"
) -> list[SchedulerOutput]:
    """One event per `chunk` ids; the last one carries finish_reason (if any)."""
    ids = tuple(token_ids)
    events = [SchedulerOutput(token_ids=ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    events = events or [SchedulerOutput()]
    events[-1] = SchedulerOutput(token_ids=events[-1].token_ids, finish_reason=finish_reason)
    return events


def run_pipeline(
    tokenizer: ModelTokenizer,
    events: Sequence[SchedulerOutput],
    stop: Sequence[str] = (),
    prompt: str = "x",
) -> list[OutputDelta]:
    """Feeds `events` one second apart (started at t=0) until a delta finishes."""
    pipeline = OutputPipeline.create(tokenizer.tokenizer, tokenizer.encode(prompt), stop, 0.0)
    deltas = []
    for now_s, event in enumerate(events, start=1):
        delta = pipeline.step(event, float(now_s))
        if delta is not None:
            deltas.append(delta)
            if delta.finish_reason:
                break
    return deltas


@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_full_decode(tokenizer: ModelTokenizer, chunk: int) -> None:
    output_ids = tokenizer.encode(MIXED_TEXT)
    deltas = run_pipeline(tokenizer, events_for(output_ids, chunk=chunk))
    assert "".join(d.text for d in deltas) == MIXED_TEXT
    assert [t for d in deltas for t in d.token_ids] == output_ids
    assert all(not d.finish_reason and d.usage is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == "length"


def test_multibyte_characters_are_never_split(tokenizer: ModelTokenizer) -> None:
    text = "🦊🎉 日本 👨‍👩‍👧 ok"
    deltas = run_pipeline(tokenizer, events_for(tokenizer.encode(text)))
    assert "".join(d.text for d in deltas) == text
    assert all("\ufffd" not in d.text for d in deltas)
    assert any(d.token_ids and not d.text for d in deltas)


def test_stop_string_across_tokens_ends_the_stream(tokenizer: ModelTokenizer) -> None:
    output_ids = tokenizer.encode("Hello there, my friend. More text that must not appear.")
    deltas = run_pipeline(
        tokenizer, events_for(output_ids, finish_reason=""), stop=["never matches", "my fri"]
    )
    assert "".join(d.text for d in deltas) == "Hello there, "
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].usage is not None


def test_held_back_text_is_released_when_the_stop_does_not_complete(
    tokenizer: ModelTokenizer,
) -> None:
    text = "A good friend. The end"
    deltas = run_pipeline(
        tokenizer,
        events_for(tokenizer.encode(text), finish_reason="abort"),
        stop=["friendly", "The endgame"],
    )
    assert "".join(d.text for d in deltas) == text
    assert deltas[-1].finish_reason == "abort"


def test_finish_flushes_text_held_for_a_stop(tokenizer: ModelTokenizer) -> None:
    output = OutputText(tokenizer.tokenizer, tokenizer.encode("x"), ["end"])
    step = output.add(tokenizer.encode("The en"))
    assert not step.stopped and "en" not in step.text
    assert output.finish().text == "en"


def test_usage_and_timings_on_the_last_delta(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode("one two three")
    pipeline = OutputPipeline.create(tokenizer.tokenizer, tokenizer.encode("hi"), (), 10.0)
    first = pipeline.step(
        SchedulerOutput(
            token_ids=tuple(ids[:1]), queue_ms=12.5, num_cached_tokens=4, num_prompt_tokens=7
        ),
        10.25,
    )
    assert first is not None and first.usage is None and first.timings is None
    last = pipeline.step(SchedulerOutput(token_ids=tuple(ids[1:]), finish_reason="length"), 11.0)
    assert last is not None
    assert last.usage == Usage(prompt_tokens=7, completion_tokens=len(ids), cached_prompt_tokens=4)
    assert last.timings is not None
    assert last.timings.queue_ms == 12.5
    assert last.timings.ttft_ms == pytest.approx(250.0)
    assert last.timings.total_ms == pytest.approx(1000.0)


def test_prompt_tokens_default_to_the_local_count(tokenizer: ModelTokenizer) -> None:
    prompt_ids = tokenizer.encode("a longer prompt here")
    pipeline = OutputPipeline.create(tokenizer.tokenizer, prompt_ids, (), 0.0)
    last = pipeline.step(SchedulerOutput(finish_reason="length"), 2.0)
    assert last is not None and last.usage is not None and last.timings is not None
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == 0
    # No token was ever sent: time to first token is the whole call.
    assert last.timings.ttft_ms == last.timings.total_ms == pytest.approx(2000.0)


def test_nothing_to_send_yields_none(tokenizer: ModelTokenizer) -> None:
    pipeline = OutputPipeline.create(tokenizer.tokenizer, tokenizer.encode("x"), (), 0.0)
    assert pipeline.step(SchedulerOutput(queue_ms=3.0), 1.0) is None
    assert pipeline.progress.queue_ms == 3.0


def test_logprobs_travel_with_their_ids(tokenizer: ModelTokenizer) -> None:
    ids = tuple(tokenizer.encode("hi"))
    logprobs = tuple(TokenLogprob(t, -0.5, (t,), (-0.5,)) for t in ids)
    pipeline = OutputPipeline.create(tokenizer.tokenizer, tokenizer.encode("x"), (), 0.0)
    delta = pipeline.step(SchedulerOutput(token_ids=ids, logprobs=logprobs), 1.0)
    assert delta is not None and delta.logprobs == logprobs


def test_choices_have_their_own_text_stops_and_finish_and_share_one_usage(
    tokenizer: ModelTokenizer,
) -> None:
    """Interleaved events of three choices: each its own detokenizer and stop matcher; the
    last finish carries the usage, the prompt counted once and the completions summed."""
    prompt_ids = tokenizer.encode("x")
    pipeline = OutputPipeline.create(tokenizer.tokenizer, prompt_ids, ["STOP"], 0.0, n=3)
    texts = {0: "Hello there", 1: "Good STOP morning", 2: "日本語"}
    ids = {index: tokenizer.encode(text, add_special_tokens=False) for index, text in texts.items()}
    deltas: list[OutputDelta] = []
    longest = max(len(v) for v in ids.values())
    for position in range(longest + 1):
        for index in (2, 0, 1):
            token_ids = tuple(ids[index][position : position + 1])
            last = position == len(ids[index]) - 1
            if position >= len(ids[index]):
                continue
            event = SchedulerOutput(
                token_ids=token_ids, finish_reason="length" if last else "", index=index
            )
            delta = pipeline.step(event, float(position))
            if delta is not None:
                deltas.append(delta)
    text = {i: "".join(d.text for d in deltas if d.index == i) for i in range(3)}
    assert text == {0: "Hello there", 1: "Good ", 2: "日本語"}
    finishes = {d.index: d.finish_reason for d in deltas if d.finish_reason}
    assert finishes == {0: "length", 1: "stop", 2: "length"}
    assert [d.ends_stream for d in deltas].count(True) == 1 and deltas[-1].ends_stream
    assert all(d.usage is None for d in deltas[:-1])
    sent = sum(len(d.token_ids) for d in deltas)
    stop_at = len(tokenizer.encode("Good STOP", add_special_tokens=False))
    assert sent == len(ids[0]) + len(ids[2]) + stop_at
    assert deltas[-1].usage == Usage(
        prompt_tokens=len(prompt_ids), completion_tokens=sent, cached_prompt_tokens=0
    )
    # A choice a stop string ended may still get events from the scheduler: dropped.
    assert pipeline.step(SchedulerOutput(token_ids=(5,), index=1), 99.0) is None


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_a_reasoning_parser_splits_the_thinking_from_the_answer(
    tokenizer: ModelTokenizer, chunk: int
) -> None:
    """On the real tokenizer, however the ids arrive: the `<think>` text in reasoning_text,
    the rest in text, no tag in either, and every id still counted."""
    ids = tokenizer.encode("<think>\n2 and 2 make 4.\n</think>\n\nThe answer is 4.")
    pipeline = OutputPipeline.create(
        tokenizer.tokenizer, tokenizer.encode("x"), (), 0.0, reasoning_parser="qwen3"
    )
    deltas = [
        delta
        for now_s, event in enumerate(events_for(ids, chunk=chunk), start=1)
        if (delta := pipeline.step(event, float(now_s))) is not None
    ]
    reasoning = "".join(d.reasoning_text for d in deltas)
    answer = "".join(d.text for d in deltas)
    assert reasoning.strip() == "2 and 2 make 4."
    assert answer == "The answer is 4."
    assert sum(len(d.token_ids) for d in deltas) == len(ids)
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == len(ids)


def test_without_a_reasoning_parser_the_think_text_is_the_answer(
    tokenizer: ModelTokenizer,
) -> None:
    ids = tokenizer.encode("<think>a</think>b")
    deltas = run_pipeline(tokenizer, events_for(ids))
    assert "".join(d.text for d in deltas) == "<think>a</think>b"
    assert not any(d.reasoning_text for d in deltas)
