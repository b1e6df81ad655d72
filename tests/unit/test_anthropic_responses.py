"""Messages API responses from scripted OutputDeltas (anthropic_http/responses.py): the
event sequence of a stream, the blocks of a whole response (the same, by construction), stop
reasons and usage."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from services.contracts.usage import Usage
from services.text.tool_call_parsers import ToolCallDelta
from services.tokenizer.http.anthropic.responses import Event, MessageBuilder, sse
from services.tokenizer.output import OutputDelta

USAGE = Usage(prompt_tokens=20, completion_tokens=6, cached_prompt_tokens=16)


def builder(**fields: Any) -> MessageBuilder:
    return MessageBuilder("msg_r", "m", **{"max_tokens": 64, **fields})


def last(text: str = "", finish_reason: str = "stop", **fields: Any) -> OutputDelta:
    return OutputDelta(text, finish_reason=finish_reason, usage=USAGE, **fields)


def streamed(deltas: Sequence[OutputDelta], **fields: Any) -> tuple[list[Event], dict[str, Any]]:
    """The stream's events (message_start first) and the whole response of the same deltas."""
    stream, whole = builder(**fields), builder(**fields)
    events = [stream.message_start(20, 16)]
    for delta in deltas:
        events += stream.events(delta)
        whole.add(delta)
    return events, whole.response()


def names(events: Sequence[Event]) -> list[str]:
    return [name for name, _ in events]


def test_text_streams_as_one_block_between_message_start_and_stop() -> None:
    events, whole = streamed([OutputDelta("Hel"), OutputDelta("lo"), last("!")])
    assert names(events) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 4 and start["usage"]["output_tokens"] == 0
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": "", "citations": None},
    }
    assert [data["delta"]["text"] for _, data in events[2:5]] == ["Hel", "lo", "!"]
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "stop_details": None,
            "container": None,
        },
        "usage": {
            "input_tokens": 4,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 16,
            "output_tokens": 6,
            "output_tokens_details": None,
            "server_tool_use": None,
        },
    }
    assert whole == {
        "id": "msg_r",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "Hello!", "citations": None}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "stop_details": None,
        "container": None,
        "usage": {
            **events[-2][1]["usage"],
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
            "inference_geo": None,
            "service_tier": "standard",
        },
    }


@pytest.mark.parametrize(
    ("finish_reason", "matched_stop", "completion_tokens", "reason", "sequence"),
    [
        ("stop", "", 6, "end_turn", None),
        ("stop", "END", 6, "stop_sequence", "END"),
        ("length", "", 64, "max_tokens", None),
        ("length", "", 6, "model_context_window_exceeded", None),
        ("tool_calls", "", 6, "tool_use", None),
        ("abort", "", 6, "end_turn", None),
    ],
)
def test_stop_reasons(
    finish_reason: str,
    matched_stop: str,
    completion_tokens: int,
    reason: str,
    sequence: str | None,
) -> None:
    usage = Usage(20, completion_tokens, 0)
    delta = OutputDelta("x", finish_reason=finish_reason, matched_stop=matched_stop, usage=usage)
    events, whole = streamed([delta])
    delta = events[-2][1]["delta"]
    assert (delta["stop_reason"], delta["stop_sequence"]) == (reason, sequence)
    assert (whole["stop_reason"], whole["stop_sequence"]) == (reason, sequence)


def test_thinking_comes_first_as_its_own_block_when_enabled() -> None:
    deltas = [
        OutputDelta("", reasoning_text="Think"),
        OutputDelta("", reasoning_text="ing."),
        OutputDelta("Hi", reasoning_text=""),
        last(),
    ]
    events, whole = streamed(deltas, show_thinking=True)
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": "", "citations": None},
    ]
    thinking = [
        data["delta"] for name, data in events if data.get("index") == 0 and "delta" in data
    ]
    assert thinking == [
        {"type": "thinking_delta", "thinking": "Think"},
        {"type": "thinking_delta", "thinking": "ing."},
    ]
    assert names(events)[1:] == [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert whole["content"] == [
        {"type": "thinking", "thinking": "Thinking.", "signature": ""},
        {"type": "text", "text": "Hi", "citations": None},
    ]
    # Not enabled: the answer alone.
    _, plain = streamed(deltas)
    assert plain["content"] == [{"type": "text", "text": "Hi", "citations": None}]


def test_tool_calls_stream_as_tool_use_blocks_with_json_fragments() -> None:
    deltas = [
        OutputDelta("Let me check.\n\n"),
        OutputDelta(
            "",
            tool_calls=(
                ToolCallDelta(0, "call_abc", "get_weather", '{"city": '),
                ToolCallDelta(0, arguments='"Paris"}'),
            ),
        ),
        OutputDelta("\n", tool_calls=(ToolCallDelta(1, "call_def", "get_time", "{}"),)),
        last(finish_reason="tool_calls"),
    ]
    events, whole = streamed(deltas)
    assert names(events) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[4][1] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {
            "type": "tool_use",
            "id": "toolu_abc",
            "name": "get_weather",
            "input": {},
            "caller": {"type": "direct"},
        },
    }
    fragments = [
        data["delta"]["partial_json"]
        for name, data in events
        if name == "content_block_delta" and data["index"] == 1
    ]
    assert fragments == ['{"city": ', '"Paris"}']
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert whole["content"] == [
        # The text's trailing newlines stay (they were sent); the lone "\n" between the
        # calls is no block.
        {"type": "text", "text": "Let me check.\n\n", "citations": None},
        {
            "type": "tool_use",
            "id": "toolu_abc",
            "name": "get_weather",
            "input": {"city": "Paris"},
            "caller": {"type": "direct"},
        },
        {
            "type": "tool_use",
            "id": "toolu_def",
            "name": "get_time",
            "input": {},
            "caller": {"type": "direct"},
        },
    ]
    assert whole["stop_reason"] == "tool_use"


def test_a_call_cut_by_max_tokens_ends_the_message_at_max_tokens() -> None:
    """As Anthropic's API answers: the cut tool_use block stays (its stream showed its
    fragments) and stop_reason max_tokens tells the client the call is not whole; its input
    is no made-up object but {}."""
    usage = Usage(prompt_tokens=20, completion_tokens=64, cached_prompt_tokens=0)
    deltas = [
        OutputDelta("", tool_calls=(ToolCallDelta(0, "call_abc", "get_weather", '{"city": "Pa'),)),
        OutputDelta("", finish_reason="length", usage=usage),
    ]
    events, whole = streamed(deltas)
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    fragments = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert fragments == ['{"city": "Pa']
    assert whole["stop_reason"] == "max_tokens"
    assert [(b["type"], b["input"]) for b in whole["content"]] == [("tool_use", {})]


def test_whitespace_before_a_call_is_no_block_but_leads_text_that_follows() -> None:
    call = OutputDelta("", tool_calls=(ToolCallDelta(0, "call_1", "f", "{}"),))
    _, whole = streamed([OutputDelta("\n\n"), call, last(finish_reason="tool_calls")])
    assert [block["type"] for block in whole["content"]] == ["tool_use"]
    _, whole = streamed([OutputDelta(" "), OutputDelta("\n"), last("Hi")])
    assert whole["content"] == [{"type": "text", "text": " \nHi", "citations": None}]


def test_an_empty_answer_has_no_blocks() -> None:
    events, whole = streamed([last("")])
    assert names(events) == ["message_start", "message_delta", "message_stop"]
    assert whole["content"] == []


def test_events_frame_as_server_sent_events() -> None:
    frame = sse(("message_stop", {"type": "message_stop"}))
    assert frame == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    line = sse(("content_block_delta", {"delta": {"text": "a\nb"}})).split(b"\n")[1]
    assert json.loads(line.removeprefix(b"data: "))["delta"]["text"] == "a\nb"
