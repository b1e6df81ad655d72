"""Anthropic Messages bodies → GenerateInput (anthropic_http/schemas.py): the conversation's
blocks become chat messages and tool calls, tools and tool_choice a ToolRequest, and every
refusal names the parameter as the Messages API spells it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.contracts.errors import InvalidRequestError
from services.text.chat_template import ChatMessage, MessageToolCall, TextPart
from services.tokenizer.http.anthropic.errors import anthropic_error
from services.tokenizer.http.anthropic.schemas import (
    count_tokens_input,
    messages_input,
    parse_count_tokens,
    parse_messages,
    thinking_enabled,
)
from services.tokenizer.tool_request import ToolChoiceMode
from services.tokenizer.validation import GenerateInput

USER = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME = {"name": "get_time", "input_schema": {"type": "object"}}


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 32, "messages": [USER], **fields}).encode()


def converted(**fields: Any) -> GenerateInput:
    return messages_input(parse_messages(body(**fields)), "r")


def refusal(**fields: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        converted(**fields)
    return raised.value


def raw_refusal(raw: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        messages_input(parse_messages(json.dumps(raw).encode()), "r")
    return raised.value


def test_a_plain_request_becomes_a_chat_with_its_sampling() -> None:
    generate_input = converted(
        system="Be brief.",
        stop_sequences=["\n\n", "END"],
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        metadata={"user_id": "u-1"},
        service_tier="auto",
        cache_control={"type": "ephemeral"},
    )
    assert generate_input.messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", USER["content"]),
    )
    sampling = generate_input.sampling
    assert sampling.max_new_tokens == 32
    assert sampling.stop == ("\n\n", "END")
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.9, 40)
    assert generate_input.model == "m" and generate_input.request_id == "r"
    assert generate_input.tool_request is None


def test_system_text_blocks_and_user_text_blocks_stay_parts() -> None:
    generate_input = converted(
        system=[{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "B"}]}],
    )
    assert generate_input.messages == (
        ChatMessage("system", (TextPart("A"),)),
        ChatMessage("user", (TextPart("B"),)),
    )


def test_a_tool_use_round_trip_becomes_calls_and_tool_messages() -> None:
    messages = [
        USER,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need the tools.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18°C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "no clock"}],
                    "is_error": True,
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    generate_input = converted(messages=messages, tools=[WEATHER, TIME])
    assert generate_input.messages == (
        ChatMessage("user", USER["content"]),
        ChatMessage(
            "assistant",
            (TextPart("Checking."),),
            tool_calls=(
                MessageToolCall("toolu_1", "get_weather", '{"city": "Paris"}'),
                MessageToolCall("toolu_2", "get_time", "{}"),
            ),
        ),
        ChatMessage("tool", "18°C", tool_call_id="toolu_1"),
        ChatMessage("tool", (TextPart("Error: "), TextPart("no clock")), tool_call_id="toolu_2"),
        ChatMessage("user", (TextPart("And tomorrow?"),)),
    )


@pytest.mark.parametrize(
    ("choice", "mode", "name", "parallel"),
    [
        (None, ToolChoiceMode.AUTO, "", True),
        ({"type": "auto"}, ToolChoiceMode.AUTO, "", True),
        ({"type": "any", "disable_parallel_tool_use": True}, ToolChoiceMode.REQUIRED, "", False),
        ({"type": "tool", "name": "get_time"}, ToolChoiceMode.FUNCTION, "get_time", True),
        ({"type": "none"}, ToolChoiceMode.NONE, "", True),
    ],
)
def test_tools_and_tool_choice_become_a_tool_request(
    choice: dict[str, Any] | None, mode: ToolChoiceMode, name: str, parallel: bool
) -> None:
    fields: dict[str, Any] = {"tools": [WEATHER, TIME]}
    if choice is not None:
        fields["tool_choice"] = choice
    request = converted(**fields).tool_request
    assert request is not None
    assert [tool.name for tool in request.tools] == ["get_weather", "get_time"]
    assert request.tools[0].description == "The weather in a city"
    assert request.tools[0].parameters == WEATHER["input_schema"]
    assert (request.choice, request.function_name, request.parallel_calls) == (
        mode,
        name,
        parallel,
    )


def test_no_tools_and_a_choice_that_forces_none_is_no_tool_request() -> None:
    assert converted(tool_choice={"type": "auto"}).tool_request is None
    assert converted(tool_choice={"type": "none"}, tools=[]).tool_request is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"output_config": {"effort": "low"}}, "output_config"),
        ({"container": "c"}, "container"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"metadata": {"user_id": "u", "session": "s"}}, "metadata.session"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"system": [{"type": "image", "source": {}}]}, "system[0].type"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [{**TIME, "defer_loading": True}]}, "tools[0].defer_loading"),
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
        ({"tools": [TIME, TIME]}, "tools[1].name"),
        ({"tools": [TIME], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tools": [TIME], "tool_choice": {"type": "auto", "name": "x"}}, "tool_choice.name"),
        ({"tools": [TIME], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled", "display": "hidden"}}, "thinking.display"),
        ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    ],
)
def test_refusals_name_the_parameter(fields: dict[str, Any], param: str) -> None:
    assert refusal(**fields).field == param


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "system", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x", "name": "n"}], "messages[0].name"),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "see"},
                        {"type": "image", "source": {"type": "url", "url": "http://x"}},
                    ],
                }
            ],
            "messages[0].content[1].type",
        ),
        (
            [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0].type"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}],
            "messages[0].content[0].extra",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ],
            "messages[0].content[0].type",
        ),
        (
            [
                USER,
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                USER,
            ],
            "messages[1].content[0].type",
        ),
        (
            [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}],
            "messages[0].content[0].input",
        ),
        (
            [
                USER,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                },
            ],
            "messages[1].content",
        ),
    ],
)
def test_message_refusals_name_the_block(messages: list[Any], param: str) -> None:
    assert refusal(messages=messages).field == param


def test_required_parameters_are_named() -> None:
    assert raw_refusal({"model": "m", "messages": [USER]}).field == "max_tokens"
    assert raw_refusal({"max_tokens": 1, "messages": [USER]}).field == "model"
    assert raw_refusal({"model": "m", "max_tokens": 1}).field == "messages"


def test_an_image_block_is_refused_saying_what_it_is() -> None:
    error = refusal(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert "'image'" in error.message


def test_thinking_shows_only_with_a_reasoning_parser() -> None:
    assert converted(thinking={"type": "disabled"}).messages
    enabled = {"type": "enabled", "budget_tokens": 2048}
    assert converted(thinking=enabled).messages
    parsed = parse_messages(body(thinking=enabled))
    assert thinking_enabled(parsed, "qwen3")
    # Without a parser thinking cannot be told from the answer: text blocks only, no 400.
    assert not thinking_enabled(parsed, None)
    assert not thinking_enabled(parse_messages(body(thinking={"type": "disabled"})), "qwen3")
    assert not thinking_enabled(parse_messages(body()), "qwen3")
    omitted = parse_messages(body(thinking={**enabled, "display": "omitted"}))
    assert not thinking_enabled(omitted, "qwen3")
    summarized = parse_messages(body(thinking={**enabled, "display": "summarized"}))
    assert thinking_enabled(summarized, "qwen3")


def test_a_final_assistant_message_is_a_prefill_to_continue() -> None:
    prefill = {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}
    generate_input = converted(messages=[USER, prefill])
    assert generate_input.continue_final_message
    assert generate_input.messages[-1] == ChatMessage("assistant", (TextPart("The answer is"),))
    assert not converted(messages=[USER]).continue_final_message
    # An empty final assistant message continues nothing: an ordinary answer.
    empty = converted(messages=[USER, {"role": "assistant", "content": ""}])
    assert not empty.continue_final_message and generate_input.messages[-1].role == "assistant"
    assert empty.messages[-1].role == "user"
    # Nothing but an empty assistant message: no messages left, no crash (validation then
    # refuses the empty prompt, naming `messages`).
    alone = converted(messages=[{"role": "assistant", "content": ""}])
    assert alone.messages == () and not alone.continue_final_message
    counted = count_tokens_input(
        parse_count_tokens(json.dumps({"model": "m", "messages": [USER, prefill]}).encode())
    )
    assert counted.continue_final_message


def test_count_tokens_takes_the_conversation_without_generation_parameters() -> None:
    raw = {"model": "m", "messages": [USER], "system": "S", "tools": [WEATHER]}
    generate_input = count_tokens_input(parse_count_tokens(json.dumps(raw).encode()))
    assert generate_input.messages[0] == ChatMessage("system", "S")
    assert generate_input.tool_request is not None
    for extra in ({"max_tokens": 5}, {"stream": True}, {"temperature": 0.5}):
        with pytest.raises(InvalidRequestError) as raised:
            parse_count_tokens(json.dumps({**raw, **extra}).encode())
        assert raised.value.field == next(iter(extra))


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("sampling.max_new_tokens", "max_tokens"),
        ("sampling.stop", "stop_sequences"),
        ("sampling.top_p", "top_p"),
        ("prompt", "messages"),
        ("messages", "messages"),
        ("tool_choice", "tool_choice"),
    ],
)
def test_validation_errors_come_out_in_anthropic_shape_and_names(field: str, param: str) -> None:
    error = anthropic_error(InvalidRequestError(field, "is bad"), "req-1")
    assert error.status == 400
    assert error.body() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": f"{param}: is bad"},
        "request_id": "req-1",
    }
