"""Tool calls parsed from each family's format: content and calls apart, arguments as JSON text,
the same events however the output is cut into deltas, and text that only looks like a call
kept as content."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.text.tool_call_parsers import (
    CallArguments,
    CallStarted,
    ContentText,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
)


def ids() -> object:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
TIME = {"name": "get_time", "arguments": {"zone": "UTC"}}


def hermes(*calls: dict) -> str:
    return "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)


@pytest.mark.parametrize(
    ("parser", "text", "content", "names"),
    [
        ("hermes", "Let me check.\n" + hermes(WEATHER), "Let me check.\n\n", ["get_weather"]),
        ("hermes", hermes(WEATHER, TIME), "\n\n", ["get_weather", "get_time"]),
        ("hermes", "no call here", "no call here", []),
        ("hermes", "<tool_call>{bad json}</tool_call>", "<tool_call>{bad json}</tool_call>", []),
        ("hermes", '<tool_call>{"name": "x"', '<tool_call>{"name": "x"', []),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
            "",
            ["get_weather"],
        ),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}; '
            '{"name": "get_time", "parameters": {}}',
            "",
            ["get_weather", "get_time"],
        ),
        ("llama3_json", "It is sunny.", "It is sunny.", []),
        ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
        ("mistral", "[TOOL_CALLS]" + json.dumps([WEATHER, TIME]), "", ["get_weather", "get_time"]),
        ("mistral", "Sunny.", "Sunny.", []),
        ("json", json.dumps(WEATHER), "", ["get_weather"]),
        ("json", json.dumps([WEATHER, TIME]), "", ["get_weather", "get_time"]),
        ("json", "[1, 2]", "[1, 2]", []),
    ],
)
def test_each_format(parser: str, text: str, content: str, names: list[str]) -> None:
    got_content, calls = parse_tool_calls(parser, text, ids())  # type: ignore[arg-type]
    assert got_content == content
    assert [c.name for c in calls] == names
    assert [c.id for c in calls] == [f"call_{i}" for i in range(len(names))]
    for call in calls:
        json.loads(call.arguments)  # always JSON text


def test_arguments_are_the_objects_json_text() -> None:
    _, calls = parse_tool_calls("hermes", hermes(WEATHER), ids())  # type: ignore[arg-type]
    assert calls == [ToolCall("call_0", "get_weather", '{"city": "Paris", "unit": "C"}')]


def events_of(parser: str, pieces: list[str]) -> list[object]:
    stream = ToolCallStream(parser, ids())  # type: ignore[arg-type]
    events: list[object] = []
    for piece in pieces:
        events.extend(stream.feed(piece))
    events.extend(stream.finish())
    return merged(events)


def merged(events: list[object]) -> list[object]:
    """Adjacent content events joined (how they are cut is not part of the contract)."""
    out: list[object] = []
    for event in events:
        if isinstance(event, ContentText) and out and isinstance(out[-1], ContentText):
            out[-1] = ContentText(out[-1].text + event.text)
        elif not (isinstance(event, ContentText) and not event.text):
            out.append(event)
    return out


OUTPUTS = [
    ("hermes", "Checking <tool> first.\n" + hermes(WEATHER) + "done <tool_call"),
    ("hermes", hermes(WEATHER, TIME)),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    ("llama3_json", "plain answer"),
    ("mistral", "[TOOL_CALLS]" + json.dumps([TIME])),
    ("json", json.dumps(WEATHER)),
]


@given(output=st.sampled_from(OUTPUTS), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_any_cut_into_deltas_gives_the_same_events(
    output: tuple[str, str], cuts: list[int]
) -> None:
    parser, text = output
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert events_of(parser, pieces) == events_of(parser, [text])


def test_a_call_streams_as_its_start_then_its_arguments() -> None:
    assert events_of("hermes", ["Hi ", "<tool_", "call>", json.dumps(TIME), "</tool_call>"]) == [
        ContentText("Hi "),
        CallStarted(0, "call_0", "get_time"),
        CallArguments(0, '{"zone": "UTC"}'),
    ]


def test_an_unknown_parser_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, json"):
        ToolCallStream("pythonic")
