"""`llmserve chat --tools FILE.json --tool-choice ...`: the file in OpenAI's tool-list shape (or
bare function objects) → the gRPC tools, refusals naming the file and the tool; and the
gRPC tool choice read back by the tokenizer tier, an unknown mode refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protos.llmserve.v1 import text_pb2
from services.client import tool_choice, tools_from_file
from services.contracts.errors import InvalidRequestError
from services.tokenizer.convert import tool_request
from services.tokenizer.tool_request import ToolChoiceMode

WEATHER = {"name": "get_weather", "parameters": {"type": "object"}, "strict": True}


def write(tmp_path: Path, content: str) -> str:
    path = tmp_path / "tools.json"
    path.write_text(content)
    return str(path)


def test_openai_tools_and_bare_functions_are_read(tmp_path: Path) -> None:
    listed = [{"type": "function", "function": WEATHER}, {"name": "now", "description": "d"}]
    tools = tools_from_file(write(tmp_path, json.dumps(listed)))
    assert [(t.name, t.description, t.strict) for t in tools] == [
        ("get_weather", "", True),
        ("now", "d", False),
    ]
    assert json.loads(tools[0].parameters) == {"type": "object"}


@pytest.mark.parametrize(
    ("content", "words"),
    [("[1", "--tools"), ('{"name": "f"}', "JSON list"), ('[{"description": "x"}]', "tool 0")],
)
def test_a_bad_tools_file_is_refused_naming_it(tmp_path: Path, content: str, words: str) -> None:
    with pytest.raises(SystemExit) as raised:
        tools_from_file(write(tmp_path, content))
    assert words in str(raised.value) and "tools.json" in str(raised.value)


def test_tool_choices_round_trip_through_the_tier() -> None:
    tools = [text_pb2.Tool(name="get_weather")]
    for value, mode in [
        ("auto", ToolChoiceMode.AUTO),
        ("none", ToolChoiceMode.NONE),
        ("required", ToolChoiceMode.REQUIRED),
        ("get_weather", ToolChoiceMode.FUNCTION),
    ]:
        request = text_pb2.GenerateRequest(tools=tools, tool_choice=tool_choice(value))
        read = tool_request(request)
        assert read is not None and read.choice is mode
        assert read.function_name == (value if mode is ToolChoiceMode.FUNCTION else "")


def test_an_unknown_tool_choice_mode_is_refused_by_name() -> None:
    request = text_pb2.GenerateRequest(tools=[text_pb2.Tool(name="f")])
    request.tool_choice.mode = 42  # type: ignore[assignment]  # an open enum takes any number
    with pytest.raises(InvalidRequestError) as raised:
        tool_request(request)
    assert raised.value.field == "tool_choice.mode"
