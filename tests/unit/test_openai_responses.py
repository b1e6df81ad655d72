"""OpenAI response bodies and stream chunks from OutputDeltas, and their SSE framing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.contracts.usage import Usage
from services.tokenizer.http.openai.responses import (
    DONE_EVENT,
    ResponseBuilder,
    sse_event,
    usage_body,
)
from services.tokenizer.output import OutputDelta, TokenLogprob

USAGE = Usage(prompt_tokens=11, completion_tokens=3, cached_prompt_tokens=8)


def token_text(token_id: int) -> str:
    return f"<{token_id}>"


def builder(chat: bool, **fields: Any) -> ResponseBuilder:
    return ResponseBuilder(
        chat=chat, request_id="r42", model="tiny", token_text=token_text, created=1700, **fields
    )


def logprob(token_id: int, value: float, *alternatives: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(
        token_id,
        value,
        tuple(t for t, _ in alternatives),
        tuple(lp for _, lp in alternatives),
    )


LOGPROBS = (
    logprob(1, -0.1, (1, -0.1), (9, -2.5), (4, -3.0)),
    logprob(22, -0.7, (22, -0.7), (5, -1.0), (6, -4.0)),
    logprob(333, -1.2, (7, -0.9), (333, -1.2), (8, -2.0)),
)

STREAM = (
    OutputDelta("Hel", (1,), LOGPROBS[:1]),
    OutputDelta("lo", (22,), LOGPROBS[1:2]),
    OutputDelta("!", (333,), LOGPROBS[2:], finish_reason="stop", usage=USAGE),
)


def stream_chunks(build: ResponseBuilder, deltas: tuple[OutputDelta, ...]) -> list[dict[str, Any]]:
    chunks = build.first_chunks() if build.chat else []
    for delta in deltas:
        chunks += build.chunks(delta)
    return chunks


# ---- chat streams ---------------------------------------------------------------------------


def test_chat_stream_opens_with_the_role_and_empty_content() -> None:
    (first,) = builder(chat=True).first_chunks()
    assert first["object"] == "chat.completion.chunk"
    assert first["id"] == "chatcmpl-r42" and first["model"] == "tiny" and first["created"] == 1700
    (choice,) = first["choices"]
    assert choice["delta"] == {"role": "assistant", "content": ""}
    assert choice["finish_reason"] is None
    assert "usage" not in first


def test_chat_stream_text_deltas_and_the_finish_chunk() -> None:
    chunks = stream_chunks(builder(chat=True), STREAM)
    assert len(chunks) == 4
    assert all(c["id"] == "chatcmpl-r42" for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    # The role comes once, in the first chunk.
    assert [d.get("role") for d in deltas] == ["assistant", None, None, None]
    assert "".join(d.get("content", "") for d in deltas) == "Hello!"
    assert [d["content"] for d in deltas[1:]] == ["Hel", "lo", "!"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finish == [None, None, None, "stop"]
    assert all("usage" not in c for c in chunks)
    # No logprobs asked for: none in any chunk.
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)


def test_chat_role_comes_with_the_first_text_without_a_first_chunk() -> None:
    build = builder(chat=True)
    first, second = build.chunks(STREAM[0]), build.chunks(STREAM[1])
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert second[0]["choices"][0]["delta"] == {"content": "lo"}


def test_a_finish_without_text_has_an_empty_delta() -> None:
    build = builder(chat=True)
    build.first_chunks()
    build.chunks(OutputDelta("Hi", (5,)))
    (finish,) = build.chunks(OutputDelta("", finish_reason="length", usage=USAGE))
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "length"


def test_a_delta_with_nothing_to_say_gives_no_chunk() -> None:
    # Ids whose text is held back (half a character, a possible stop string).
    assert builder(chat=True).chunks(OutputDelta("", (17,))) == []
    assert builder(chat=False).chunks(OutputDelta("", (17,))) == []


@pytest.mark.parametrize("chat", [True, False])
def test_include_usage_adds_a_usage_chunk_after_the_finishing_one(chat: bool) -> None:
    chunks = stream_chunks(builder(chat=chat, include_usage=True), STREAM)
    *choices, last = chunks
    assert len(choices) == (4 if chat else 3)
    # Every chunk carries the key, null until the last.
    assert all("usage" in c and c["usage"] is None for c in choices)
    assert choices[-1]["choices"][0]["finish_reason"] == "stop"
    assert last["choices"] == []
    assert last["id"] == choices[0]["id"] and last["object"] == choices[0]["object"]
    assert last["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 3,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_include_usage_marks_the_first_chunk_too() -> None:
    (first,) = builder(chat=True, include_usage=True).first_chunks()
    assert "usage" in first and first["usage"] is None


def test_usage_body_totals_prompt_and_completion() -> None:
    usage = usage_body(Usage(prompt_tokens=100, completion_tokens=23, cached_prompt_tokens=64))
    assert usage["total_tokens"] == 123
    assert usage["prompt_tokens_details"] == {"cached_tokens": 64}


# ---- completions streams --------------------------------------------------------------------


def test_completions_chunks_carry_text() -> None:
    chunks = stream_chunks(builder(chat=False), STREAM)
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    assert all(c["id"] == "cmpl-r42" for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert [c["text"] for c in choices] == ["Hel", "lo", "!"]
    assert all("delta" not in c and "message" not in c for c in choices)
    assert [c["finish_reason"] for c in choices] == [None, None, "stop"]
    assert all(c["index"] == 0 for c in choices)


# ---- whole responses ------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [True, False])
def test_a_whole_response_joins_the_text(chat: bool) -> None:
    build = builder(chat=chat)
    for delta in STREAM:
        build.add(delta)
    body = build.response()
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["id"] == ("chatcmpl-r42" if chat else "cmpl-r42")
    (choice,) = body["choices"]
    if chat:
        # refusal is required (nullable) by OpenAI's ChatCompletionMessage schema.
        assert choice["message"] == {"role": "assistant", "content": "Hello!", "refusal": None}
    else:
        assert choice["text"] == "Hello!"
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None
    assert body["usage"]["total_tokens"] == 14
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 8


def test_a_whole_response_keeps_the_finish_reason_of_the_last_delta_that_had_one() -> None:
    build = builder(chat=True)
    build.add(OutputDelta("abc", (1, 2, 3)))
    build.add(OutputDelta("", finish_reason="length", usage=USAGE))
    body = build.response()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == "abc"


def test_a_whole_response_without_usage_has_no_usage_key() -> None:
    build = builder(chat=False)
    build.add(OutputDelta("x", (1,)))
    body = build.response()
    assert "usage" not in body
    assert body["choices"][0]["finish_reason"] is None


# ---- logprobs: chat -------------------------------------------------------------------------


def test_chat_logprobs_shape() -> None:
    build = builder(chat=True, top_logprobs=2)
    for delta in STREAM:
        build.add(delta)
    logprobs = build.response()["choices"][0]["logprobs"]
    assert logprobs["refusal"] is None
    content = logprobs["content"]
    assert [c["token"] for c in content] == ["<1>", "<22>", "<333>"]
    assert [c["logprob"] for c in content] == [-0.1, -0.7, -1.2]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert len(entry["top_logprobs"]) == 2
        for top in entry["top_logprobs"]:
            assert top["bytes"] == list(top["token"].encode("utf-8"))
    assert content[2]["top_logprobs"] == [
        {"token": "<7>", "logprob": -0.9, "bytes": list(b"<7>")},
        {"token": "<333>", "logprob": -1.2, "bytes": list(b"<333>")},
    ]


def test_chat_logprobs_bytes_are_utf8() -> None:
    build = ResponseBuilder(
        chat=True, request_id="r", model="m", token_text=lambda i: "é中", top_logprobs=1
    )
    (chunk,) = build.chunks(OutputDelta("é中", (1,), (logprob(1, -0.5, (1, -0.5)),)))
    entry = chunk["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == [0xC3, 0xA9, 0xE4, 0xB8, 0xAD]
    assert bytes(entry["bytes"]).decode("utf-8") == "é中"


@pytest.mark.parametrize("count", [0, 1, 3, 10])
def test_chat_top_logprobs_limited_to_the_count(count: int) -> None:
    build = builder(chat=True, top_logprobs=count)
    (chunk,) = build.chunks(STREAM[0])
    (entry,) = chunk["choices"][0]["logprobs"]["content"]
    assert entry["token"] == "<1>"  # the chosen token is there even with no alternatives
    tops = entry["top_logprobs"]
    assert len(tops) == min(count, 3)
    assert [t["token"] for t in tops] == ["<1>", "<9>", "<4>"][:count]


def test_chat_stream_logprobs_per_chunk() -> None:
    chunks = stream_chunks(builder(chat=True, top_logprobs=1), STREAM)
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk has no token
    per_chunk = [[e["token"] for e in c["choices"][0]["logprobs"]["content"]] for c in chunks[1:]]
    assert per_chunk == [["<1>"], ["<22>"], ["<333>"]]


def test_logprobs_alone_make_a_chunk() -> None:
    # A token whose text is held back still reports its logprob when they were asked for.
    (chunk,) = builder(chat=True, top_logprobs=0).chunks(OutputDelta("", (1,), LOGPROBS[:1]))
    assert chunk["choices"][0]["logprobs"]["content"][0]["token"] == "<1>"
    assert builder(chat=True).chunks(OutputDelta("", (1,), LOGPROBS[:1])) == []


# ---- logprobs: completions ------------------------------------------------------------------


def test_completions_logprobs_shape() -> None:
    build = builder(chat=False, top_logprobs=2)
    for delta in STREAM:
        build.add(delta)
    logprobs = build.response()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<1>", "<22>", "<333>"]
    assert logprobs["token_logprobs"] == [-0.1, -0.7, -1.2]
    assert logprobs["top_logprobs"] == [
        {"<1>": -0.1, "<9>": -2.5},
        {"<22>": -0.7, "<5>": -1.0},
        {"<7>": -0.9, "<333>": -1.2},
    ]
    # Offsets into the generated text: "<1>" is 3 characters, "<22>" 4.
    assert logprobs["text_offset"] == [0, 3, 7]


def test_completions_text_offset_runs_on_across_stream_chunks() -> None:
    build = builder(chat=False, top_logprobs=1)
    offsets: list[int] = []
    tokens: list[str] = []
    for delta in STREAM:
        for chunk in build.chunks(delta):
            offsets += chunk["choices"][0]["logprobs"]["text_offset"]
            tokens += chunk["choices"][0]["logprobs"]["tokens"]
    expected, position = [], 0
    for token in tokens:
        expected.append(position)
        position += len(token)
    assert offsets == expected == [0, 3, 7]


def test_completions_text_offset_counts_characters_in_a_chunk_of_several_tokens() -> None:
    build = ResponseBuilder(
        chat=False,
        request_id="r",
        model="m",
        token_text={1: "é", 2: "ab", 3: "中c"}.__getitem__,
        top_logprobs=0,
    )
    (chunk,) = build.chunks(
        OutputDelta("éab", (1, 2), (logprob(1, -1.0, (1, -1.0)), logprob(2, -2.0, (2, -2.0))))
    )
    (later,) = build.chunks(OutputDelta("中c", (3,), (logprob(3, -3.0, (3, -3.0)),)))
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert later["choices"][0]["logprobs"]["text_offset"] == [3]


@pytest.mark.parametrize(
    ("count", "listed"),
    [(0, ["<333>"]), (1, ["<7>", "<333>"]), (2, ["<7>", "<333>"]), (3, ["<7>", "<333>", "<8>"])],
)
def test_completions_top_logprobs_are_the_count_plus_the_sampled_token(
    count: int, listed: list[str]
) -> None:
    # As vLLM: the sampled token (333) is always listed, so logprobs: 0 is not [{}].
    (chunk,) = builder(chat=False, top_logprobs=count).chunks(STREAM[2])
    (top,) = chunk["choices"][0]["logprobs"]["top_logprobs"]
    assert list(top) == listed
    assert top["<333>"] == -1.2


@pytest.mark.parametrize("chat", [True, False])
def test_return_token_ids_also_returns_the_prompt_token_ids(chat: bool) -> None:
    build = builder(chat, return_token_ids=True, prompt_token_ids=(5, 6, 7))
    streamed = stream_chunks(build, STREAM)
    for delta in STREAM:
        build.add(delta)
    body = build.response()
    if chat:
        assert body["prompt_token_ids"] == [5, 6, 7]
        assert streamed[0]["prompt_token_ids"] == [5, 6, 7]
    else:
        assert body["choices"][0]["prompt_token_ids"] == [5, 6, 7]
        assert streamed[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert sum("prompt_token_ids" in str(chunk) for chunk in streamed) == 1


@pytest.mark.parametrize("chat", [True, False])
def test_no_logprobs_asked_for_gives_null(chat: bool) -> None:
    build = builder(chat=chat, top_logprobs=None)
    chunks = stream_chunks(build, STREAM)
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)
    for delta in STREAM:
        build.add(delta)
    choice = build.response()["choices"][0]
    assert "logprobs" in choice and choice["logprobs"] is None


# ---- server-sent events ---------------------------------------------------------------------


def frame(event: bytes) -> Any:
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    # One data line and the blank line that ends the event: no newline anywhere else.
    assert event.count(b"\n\n") == 1 and event.count(b"\n") == 2
    assert b"\r" not in event
    return json.loads(event[len(b"data: ") : -2])


def test_sse_event_holds_the_payload_as_one_data_line() -> None:
    chunks = stream_chunks(builder(chat=True, include_usage=True, top_logprobs=1), STREAM)
    for chunk in chunks:
        assert frame(sse_event(chunk)) == chunk


def test_sse_event_keeps_non_ascii_text() -> None:
    payload = {"choices": [{"text": "héllo 中文 🙂"}]}
    event = sse_event(payload)
    assert "héllo 中文 🙂".encode() in event  # as UTF-8, not \\u escapes
    assert frame(event) == payload


@pytest.mark.parametrize("text", ["line one\nline two", "\n\n", "a\r\nb", "end\n"])
def test_sse_event_with_newlines_in_the_text_is_still_one_data_line(text: str) -> None:
    payload = {"choices": [{"delta": {"content": text}}]}
    assert frame(sse_event(payload)) == payload


def test_the_done_event() -> None:
    assert DONE_EVENT == b"data: [DONE]\n\n"


# ---- n > 1 ----------------------------------------------------------------------------------

CHOICES = (
    OutputDelta("A", (1,), index=1),
    OutputDelta("B", (2,), index=0),
    OutputDelta("a", (3,), finish_reason="stop", index=1),
    OutputDelta("b", (4,), finish_reason="length", index=0, usage=USAGE),
)


@pytest.mark.parametrize("chat", [True, False])
def test_a_stream_of_choices_names_each_by_index(chat: bool) -> None:
    build = builder(chat, n=2, include_usage=True)
    chunks = stream_chunks(build, CHOICES)
    if chat:
        # One role chunk per choice, each with that choice alone.
        assert [[c["index"] for c in chunk["choices"]] for chunk in chunks[:2]] == [[0], [1]]
        chunks = chunks[2:]
    *choice_chunks, usage_chunk = chunks
    key = "delta" if chat else "text"
    texts: dict[int, str] = {}
    for chunk in choice_chunks:
        (choice,) = chunk["choices"]
        part = choice[key]["content"] if chat else choice[key]
        texts[choice["index"]] = texts.get(choice["index"], "") + part
    assert texts == {0: "Bb", 1: "Aa"}
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in choice_chunks}
    assert finishes == {1: "stop", 0: "length"}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == usage_body(USAGE)


@pytest.mark.parametrize("chat", [True, False])
def test_a_whole_response_lists_the_choices_in_index_order(chat: bool) -> None:
    build = builder(chat, n=3, return_token_ids=True)
    for delta in CHOICES:
        build.add(delta)
    body = build.response()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] if chat else c["text"] for c in body["choices"]]
    assert texts == ["Bb", "Aa", ""]
    assert [c["token_ids"] for c in body["choices"]] == [[2, 4], [1, 3], []]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop", None]
    assert body["usage"] == usage_body(USAGE)


REASONING_STREAM = [
    OutputDelta("", (1,), reasoning_text="2 and 2"),
    OutputDelta("", (2,), reasoning_text=" make 4."),
    OutputDelta("It is 4.", (3,)),
    OutputDelta("", (), finish_reason="stop", usage=Usage(5, 3, 0)),
]


def test_chat_stream_sends_reasoning_as_reasoning_content_apart_from_content() -> None:
    chunks = [c for d in REASONING_STREAM for c in builder(chat=True).chunks(d)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert [d.get("reasoning_content") for d in deltas] == ["2 and 2", " make 4.", None, None]
    assert [d.get("content") for d in deltas] == [None, None, "It is 4.", None]


def test_a_whole_chat_response_carries_the_reasoning_beside_the_content() -> None:
    whole = builder(chat=True)
    for delta in REASONING_STREAM:
        whole.add(delta)
    message = whole.response()["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "It is 4.",
        "refusal": None,
        "reasoning_content": "2 and 2 make 4.",
    }


def test_without_reasoning_a_chat_message_has_no_reasoning_field() -> None:
    whole = builder(chat=True)
    whole.add(OutputDelta("hi", (1,), finish_reason="stop", usage=Usage(1, 1, 0)))
    assert "reasoning_content" not in whole.response()["choices"][0]["message"]


def test_each_of_n_choices_opens_with_its_own_role_chunk() -> None:
    # As OpenAI and vLLM: one choice per chunk, so a client keyed on choices[0] sees each role.
    firsts = builder(chat=True, n=2).first_chunks()
    assert [[c["index"] for c in chunk["choices"]] for chunk in firsts] == [[0], [1]]
    assert all(chunk["choices"][0]["delta"]["role"] == "assistant" for chunk in firsts)
