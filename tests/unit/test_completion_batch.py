"""/v1/completions with several prompts and with echo, in the door's pure parts: the prompts'
streams merged into one (choices prompt-major, usage summed at the end, an error ending all),
and the bodies and chunks with each prompt echoed (null logprobs for its tokens). The real
stack is in tests/e2e/test_openai_conformance.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import pytest

from services.contracts.errors import DependencyUnavailableError, InvalidRequestError
from services.contracts.usage import Usage
from services.tokenizer.generation import GenerationStream, Prepared
from services.tokenizer.http.openai.prompt_batch import BatchStream, prepare_batch
from services.tokenizer.http.openai.responses import CompletionPrompt, ResponseBuilder
from services.tokenizer.output import OutputDelta, TokenLogprob
from services.tokenizer.validation import GenerateInput


class FakeStream:
    """A prompt's stream: its deltas (with pauses between them), or an error after them."""

    def __init__(self, deltas: Sequence[OutputDelta], error: Exception | None = None) -> None:
        self._deltas = deltas
        self._error = error
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        for delta in self._deltas:
            await asyncio.sleep(0)
            yield delta
        if self._error is not None:
            raise self._error


def usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=1)


def prompt_deltas(texts: Sequence[str], total: Usage) -> list[OutputDelta]:
    """A prompt's two choices (n = 2): a piece each, then each finishes; the last has usage."""
    return [
        OutputDelta(texts[0], index=0),
        OutputDelta(texts[1], index=1),
        OutputDelta("", index=0, finish_reason="length"),
        OutputDelta("", index=1, finish_reason="stop", usage=total),
    ]


def batch(*streams: FakeStream) -> BatchStream:
    return BatchStream(cast(list[GenerationStream], list(streams)), n=2)


async def collect(stream: BatchStream) -> list[OutputDelta]:
    return [delta async for delta in stream.deltas()]


def test_the_prompts_choices_are_numbered_prompt_major_and_usage_is_summed() -> None:
    first = FakeStream(prompt_deltas(["a0", "a1"], usage(3, 7)))
    second = FakeStream(prompt_deltas(["b0", "b1"], usage(5, 11)))
    deltas = asyncio.run(collect(batch(first, second)))
    texts = {(d.index, d.text) for d in deltas if d.text}
    assert texts == {(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")}
    finishes = {d.index: d.finish_reason for d in deltas if d.finish_reason}
    assert finishes == {0: "length", 1: "stop", 2: "length", 3: "stop"}
    # Only the very last delta ends the stream, with both prompts' tokens.
    assert [d.ends_stream for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].usage == Usage(prompt_tokens=8, completion_tokens=18, cached_prompt_tokens=2)
    assert first.cancelled and second.cancelled


def test_an_error_in_one_prompt_ends_the_batch() -> None:
    failing = FakeStream([OutputDelta("x", index=0)], DependencyUnavailableError("gone"))
    slow = FakeStream(prompt_deltas(["a", "b"], usage(1, 1)) * 50)
    with pytest.raises(DependencyUnavailableError):
        asyncio.run(collect(batch(slow, failing)))
    assert slow.cancelled and failing.cancelled


def test_a_refused_prompt_is_named_and_the_admitted_ones_are_released() -> None:
    released: list[int] = []

    class Admission:
        def __init__(self, number: int) -> None:
            self.number = number

        def release(self) -> None:
            released.append(self.number)

    async def prepare(generate_input: GenerateInput) -> Prepared:
        if generate_input.prompt == "bad":
            raise InvalidRequestError("prompt", "is too long")
        return cast(Prepared, type("P", (), {"admission": Admission(len(released) + 1)})())

    inputs = [GenerateInput(request_id=str(i), prompt=p) for i, p in enumerate(["ok", "bad"])]
    with pytest.raises(InvalidRequestError) as raised:
        asyncio.run(prepare_batch(inputs, prepare))
    assert raised.value.field == "prompt[1]"
    assert released == [1]


# ---- bodies -------------------------------------------------------------------------------


def builder(prompts: tuple[CompletionPrompt, ...], **fields: Any) -> ResponseBuilder:
    return ResponseBuilder(
        chat=False,
        request_id="r",
        model="m",
        token_text=lambda token_id: f"<{token_id}>",
        prompts=prompts,
        **fields,
    )


TWO_PROMPTS = (CompletionPrompt((1, 2), "Hi"), CompletionPrompt((3,), "Yo"))


def test_a_whole_batch_response_echoes_each_prompt_in_its_choices() -> None:
    build = builder(TWO_PROMPTS, n=2)
    for index, text in enumerate(["a", "b", "c", "d"]):
        build.add(OutputDelta(text, (9,), index=index, finish_reason="stop"))
    build.add(OutputDelta("", index=3, usage=usage(3, 4)))
    body = build.response()
    assert [c["text"] for c in body["choices"]] == ["Hia", "Hib", "Yoc", "Yod"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["total_tokens"] == 7


def test_echoed_logprobs_have_null_entries_for_the_prompt_tokens() -> None:
    build = builder(TWO_PROMPTS[:1], top_logprobs=0)
    sampled = TokenLogprob(9, -0.5, (9,), (-0.5,))
    build.add(OutputDelta("x", (9,), (sampled,), finish_reason="length", usage=usage(2, 1)))
    logprobs = build.response()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<1>", "<2>", "<9>"]
    assert logprobs["token_logprobs"] == [None, None, -0.5]
    assert logprobs["top_logprobs"] == [None, None, {"<9>": -0.5}]
    assert logprobs["text_offset"] == [0, 3, 6]


def test_a_stream_echoes_the_prompt_in_each_choices_first_chunk_only() -> None:
    build = builder(TWO_PROMPTS, return_token_ids=True)
    first = build.chunks(OutputDelta("a", (9,), index=1))
    again = build.chunks(OutputDelta("b", (9,), index=1))
    other = build.chunks(OutputDelta("c", (9,), index=0))
    assert first[0]["choices"][0]["text"] == "Yoa"
    assert first[0]["choices"][0]["prompt_token_ids"] == [3]
    assert again[0]["choices"][0]["text"] == "b"
    assert other[0]["choices"][0]["text"] == "Hic"
    assert other[0]["choices"][0]["prompt_token_ids"] == [1, 2]


def test_without_echo_a_batch_response_is_the_generated_text() -> None:
    build = builder((CompletionPrompt((1,)), CompletionPrompt((2,))))
    build.add(OutputDelta("a", index=0, finish_reason="stop"))
    build.add(OutputDelta("b", index=1, finish_reason="stop", usage=usage(2, 2)))
    assert [c["text"] for c in build.response()["choices"]] == ["a", "b"]


def test_a_streamed_echo_leads_the_first_chunks_logprobs_with_the_prompt_tokens() -> None:
    build = builder(TWO_PROMPTS[:1], top_logprobs=0)
    sampled = TokenLogprob(9, -0.5, (9,), (-0.5,))
    first = build.chunks(OutputDelta("x", (9,), (sampled,)))[0]["choices"][0]["logprobs"]
    later = build.chunks(OutputDelta("y", (9,), (sampled,)))[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"] == [None, None, -0.5]
    assert first["text_offset"] == [0, 3, 6]
    assert later["tokens"] == ["<9>"] and later["text_offset"] == [9]
