"""Forced tool calls (`tool_choice: "required"` or a named function) as they stream and when
the token limit cuts them: the required list read character by character into calls whose
argument pieces join to the arguments as written; a cut call finishes "length" and a whole
response leaves it out (its stream has sent the pieces, with "length" at the end)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from services.text.forced_calls import RequiredCallsReader
from services.text.tool_call_parsers import CallArguments, CallStarted, ToolCallDelta, ToolEvent
from services.tokenizer.http.openai.responses import ResponseBuilder
from services.tokenizer.output import OutputDelta
from services.tokenizer.tool_output import ToolCallOutput
from services.tokenizer.tool_request import FunctionTool, ToolChoiceMode, ToolRequest

TWO_CALLS = (
    '[{"name": "get_time", "arguments": {}}, '
    '{"name": "get_weather", "arguments": {"city": "Rome \\"}\\" ", "days": [1, {"a": 2}]}}]'
)
ROME_ARGUMENTS = '{"city": "Rome \\"}\\" ", "days": [1, {"a": 2}]}'


def fixed_ids() -> Any:
    ids = iter(f"call_{n}" for n in range(100))
    return lambda: next(ids)


def read(text: str, chunk: int) -> tuple[list[ToolEvent], RequiredCallsReader]:
    reader = RequiredCallsReader(fixed_ids())
    events: list[ToolEvent] = []
    for start in range(0, len(text), chunk):
        events.extend(reader.feed(text[start : start + chunk]))
    return events, reader


def joined(events: list[ToolEvent]) -> list[tuple[str, str, str]]:
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, CallStarted):
            calls[event.index] = [event.id, event.name, ""]
        elif isinstance(event, CallArguments):
            calls[event.index][2] += event.fragment
    return [(c[0], c[1], c[2]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("chunk", [1, 2, 7, 1000])
def test_the_required_list_becomes_calls_however_it_is_cut(chunk: int) -> None:
    events, reader = read(TWO_CALLS, chunk)
    assert joined(events) == [
        ("call_0", "get_time", "{}"),
        ("call_1", "get_weather", ROME_ARGUMENTS),
    ]
    assert reader.complete_calls == 2
    if chunk == 1:
        # The arguments stream as they come: one piece per character here.
        pieces = [e for e in events if isinstance(e, CallArguments) and e.index == 1]
        assert len(pieces) == len(ROME_ARGUMENTS)


def test_compact_json_and_swapped_keys_are_read_too() -> None:
    text = '[{"arguments":{"x":"1"},"name":"f"},{"name":"g","arguments":7}]'
    events, reader = read(text, 1)
    assert joined(events) == [("call_0", "f", '{"x":"1"}'), ("call_1", "g", "7")]
    assert reader.complete_calls == 2


def test_a_cut_list_has_a_started_call_that_is_not_complete() -> None:
    events, reader = read('[{"name": "get_weather", "arguments": {"city": "Ro', 3)
    assert joined(events) == [("call_0", "get_weather", '{"city": "Ro')]
    assert reader.complete_calls == 0


def test_a_list_cut_inside_the_name_starts_no_call() -> None:
    events, _ = read('[{"name": "get_wea', 1)
    assert events == []


REQUIRED = ToolRequest(
    (FunctionTool("get_time"), FunctionTool("get_weather")), ToolChoiceMode.REQUIRED
)
NAMED = replace(REQUIRED, choice=ToolChoiceMode.FUNCTION, function_name="get_weather")


@pytest.mark.parametrize("request_", [REQUIRED, NAMED])
def test_a_forced_answer_has_no_content_even_when_cut(request_: ToolRequest) -> None:
    output = ToolCallOutput(request_, "hermes", fixed_ids())
    text = '[{"name": "get_weather", "arguments": {"ci' if request_ is REQUIRED else '{"ci'
    steps = [output.feed(text[i : i + 2]) for i in range(0, len(text), 2)]
    steps.append(output.finish())
    assert "".join(step.content for step in steps) == ""
    pieces = [piece for step in steps for piece in step.calls]
    assert pieces[0].name == "get_weather"
    assert "".join(piece.arguments for piece in pieces) == '{"ci'
    assert len(pieces) > 1  # streamed, not one piece at the end


def builder(**fields: Any) -> ResponseBuilder:
    return ResponseBuilder(chat=True, request_id="r", model="m", token_text=str, **fields)


def test_a_whole_response_leaves_out_a_call_the_limit_cut() -> None:
    build = builder()
    build.add(OutputDelta("", tool_calls=(ToolCallDelta(0, "call_a", "get_time", "{}"),)))
    build.add(OutputDelta("", tool_calls=(ToolCallDelta(1, "call_b", "get_weather", '{"c'),)))
    build.add(OutputDelta("", finish_reason="length"))
    choice = build.response()["choices"][0]
    assert choice["finish_reason"] == "length"
    calls = choice["message"]["tool_calls"]
    assert [call["id"] for call in calls] == ["call_a"]  # the whole one stays


def test_a_cut_named_call_is_an_empty_length_answer() -> None:
    build = builder()
    build.add(OutputDelta("", tool_calls=(ToolCallDelta(0, "call_a", "get_weather", "{"),)))
    build.add(OutputDelta("", finish_reason="length"))
    choice = build.response()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": None, "refusal": None}
