"""Tool calling through the tokenizer tier's pure parts: an OpenAI body's tools and history →
GenerateInput; validation (a forced choice's grammar, refusals naming the field); the output
pipeline reading calls out of a choice's text (on the embedded model's real tokenizer); the
OpenAI response and stream shapes. The real stack is in tests/e2e/test_tool_calling_stack.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from services.common.model_source import embedded_model_path
from services.contracts.errors import InvalidRequestError
from services.contracts.structured_output import StructuredOutputKind
from services.text.chat_template import ChatMessage, ChatTemplate, MessageToolCall
from services.text.model_tokenizer import ModelTokenizer
from services.text.tool_call_parsers import ToolCallDelta, parser_for_template
from services.tokenizer.http.openai.responses import ResponseBuilder
from services.tokenizer.http.openai.schemas import chat_input, parse_chat
from services.tokenizer.output import OutputDelta, OutputPipeline, SchedulerOutput
from services.tokenizer.tool_output import ToolCallOutput
from services.tokenizer.tool_request import (
    FunctionTool,
    ToolChoiceMode,
    ToolRequest,
    forced_call_grammar,
)
from services.tokenizer.validation import GenerateInput, Limits, validate_generate

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def chat(**fields: Any) -> GenerateInput:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return chat_input(parse_chat(json.dumps(body).encode()), "r", 64)


def chat_error(**fields: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        chat(**fields)
    return raised.value


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_path(embedded_model_path())


LIMITS = Limits(model_name="m", max_model_len=2048, vocab_size=49152, max_new_tokens_limit=64)


# ---- the OpenAI body ----------------------------------------------------------------------


def test_tools_and_choices_become_a_tool_request() -> None:
    request = chat(tools=[WEATHER, TIME]).tool_request
    assert request is not None
    assert [t.name for t in request.tools] == ["get_weather", "get_time"]
    assert request.tools[0].parameters == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert request.choice is ToolChoiceMode.AUTO and request.parallel_calls
    named = {"type": "function", "function": {"name": "get_time"}}
    request = chat(tools=[WEATHER, TIME], tool_choice=named, parallel_tool_calls=False)
    assert request.tool_request == replace(
        request.tool_request,  # type: ignore[arg-type]
        choice=ToolChoiceMode.FUNCTION,
        function_name="get_time",
        parallel_calls=False,
    )
    for choice in ("none", "auto", "required"):
        tool_request = chat(tools=[WEATHER], tool_choice=choice).tool_request
        assert tool_request is not None and tool_request.choice.value == choice


def test_a_tool_calling_history_reaches_the_messages() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = '{"city": "Paris"}'  # type: ignore[index]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    request = chat(messages=messages, tools=[WEATHER])
    assert request.messages[1] == ChatMessage(
        "assistant", "", (MessageToolCall("call_1", "get_weather", '{"city": "Paris"}'),)
    )
    assert request.messages[2] == ChatMessage("tool", "18 C", tool_call_id="call_1")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
            "tools[0].function.x",
        ),
        (
            {"messages": [{"role": "tool", "content": "18 C"}]},
            "messages[0].tool_call_id",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
    ],
)
def test_bad_tool_fields_are_refused_by_name(fields: dict[str, Any], field: str) -> None:
    assert chat_error(**fields).field == field


@pytest.mark.parametrize(
    ("tool_request", "field", "words"),
    [
        (ToolRequest((FunctionTool("a b"),)), "tools[0].name", "characters"),
        (ToolRequest((FunctionTool("f"), FunctionTool("f"))), "tools[1].name", "twice"),
        (ToolRequest((FunctionTool("f"),), ToolChoiceMode.FUNCTION, "g"), "tool_choice", "'g'"),
        (ToolRequest((), ToolChoiceMode.REQUIRED), "tool_choice", "empty"),
    ],
)
def test_validation_checks_the_tools(
    tokenizer: ModelTokenizer, tool_request: ToolRequest, field: str, words: str
) -> None:
    request = GenerateInput(messages=(ChatMessage("user", "hi"),), tool_request=tool_request)
    with pytest.raises(InvalidRequestError) as raised:
        validate_generate(request, LIMITS, tokenizer)
    assert raised.value.field == field and words in raised.value.message


def test_tools_apply_to_chat_only_and_a_forced_call_takes_the_grammar(
    tokenizer: ModelTokenizer,
) -> None:
    tools = ToolRequest((FunctionTool("f"),), ToolChoiceMode.REQUIRED)
    with pytest.raises(InvalidRequestError) as raised:
        validate_generate(GenerateInput(prompt="x", tool_request=tools), LIMITS, tokenizer)
    assert raised.value.field == "tools"
    forced = chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(InvalidRequestError) as raised:
        validate_generate(forced, LIMITS, tokenizer)
    assert raised.value.field == "tool_choice" and "response_format" in raised.value.message
    validated = validate_generate(chat(tools=[WEATHER], tool_choice="required"), LIMITS, tokenizer)
    assert validated.sampling.structured_output == forced_call_grammar(validated.tool_request)  # type: ignore[arg-type]
    assert validated.structured_output_param == "tools"
    auto = validate_generate(chat(tools=[WEATHER]), LIMITS, tokenizer)
    assert auto.sampling.structured_output is None and auto.tool_request is not None


def test_forced_grammars_are_the_schemas() -> None:
    weather = FunctionTool("get_weather", parameters={"type": "object", "required": ["city"]})
    named = forced_call_grammar(ToolRequest((weather,), ToolChoiceMode.FUNCTION, "get_weather"))
    assert named is not None and named.kind is StructuredOutputKind.JSON_SCHEMA
    assert json.loads(named.text) == {"type": "object", "required": ["city"]}
    one = forced_call_grammar(
        ToolRequest((weather,), ToolChoiceMode.REQUIRED, parallel_calls=False)
    )
    assert one is not None
    schema = json.loads(one.text)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    item = schema["items"]["anyOf"][0]
    assert item["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert forced_call_grammar(ToolRequest((weather,))) is None


def test_the_parser_is_told_from_the_template() -> None:
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("[TOOL_CALLS] {{ x }}") == "mistral"
    assert parser_for_template("<|python_tag|>") == "llama3_json"
    assert parser_for_template("{{ messages }}") == "json"


# ---- the output pipeline ------------------------------------------------------------------


def fixed_ids() -> Any:
    ids = iter(f"call_{n}" for n in range(100))
    return lambda: next(ids)


def run(
    tokenizer: ModelTokenizer,
    text: str,
    tool_request: ToolRequest,
    parser: str = "hermes",
    chunk: int = 1,
    finish_reason: str = "stop",
) -> list[OutputDelta]:
    pipeline = OutputPipeline.create(
        tokenizer.tokenizer,
        tokenizer.encode("x"),
        (),
        0.0,
        tool_request=tool_request,
        tool_call_parser=parser,
    )
    if pipeline.tools is not None:
        pipeline.tools = [ToolCallOutput(tool_request, parser, fixed_ids())]
    ids = tokenizer.encode(text, add_special_tokens=False)
    events = [
        SchedulerOutput(token_ids=tuple(ids[i : i + chunk])) for i in range(0, len(ids), chunk)
    ]
    events[-1] = replace(events[-1], finish_reason=finish_reason)
    deltas = [pipeline.step(event, 1.0) for event in events]
    return [d for d in deltas if d is not None]


def calls_of(deltas: Sequence[OutputDelta]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call, the pieces joined as a client joins them."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            id_, name, arguments = calls.setdefault(piece.index, ["", "", ""])
            calls[piece.index] = [id_ or piece.id, name or piece.name, arguments + piece.arguments]
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


AUTO = ToolRequest((FunctionTool("get_weather"), FunctionTool("get_time")))
HERMES_TWO_CALLS = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_auto_reads_the_family_syntax_into_calls(tokenizer: ModelTokenizer, chunk: int) -> None:
    deltas = run(tokenizer, HERMES_TWO_CALLS, AUTO, chunk=chunk)
    assert calls_of(deltas) == [
        ("call_0", "get_weather", '{"city": "Paris"}'),
        ("call_1", "get_time", "{}"),
    ]
    assert "".join(d.text for d in deltas) == "Let me check.\n"
    assert deltas[-1].finish_reason == "tool_calls"
    assert sum(len(d.token_ids) for d in deltas) == len(
        tokenizer.encode(HERMES_TWO_CALLS, add_special_tokens=False)
    )


def test_a_broken_call_stays_text_and_the_answer_finishes_as_stop(
    tokenizer: ModelTokenizer,
) -> None:
    text = 'Sure <tool_call>{"name": "get_weather", "arguments": {</tool_call> done'
    deltas = run(tokenizer, text, AUTO)
    assert calls_of(deltas) == []
    assert "".join(d.text for d in deltas) == text
    assert deltas[-1].finish_reason == "stop"


def test_a_call_cut_by_length_finishes_as_length(tokenizer: ModelTokenizer) -> None:
    deltas = run(
        tokenizer, '<tool_call>{"name": "get_time", "arguments": {}}', AUTO, finish_reason="length"
    )
    assert deltas[-1].finish_reason == "length"
    assert calls_of(deltas) == []


def test_choice_none_reads_nothing(tokenizer: ModelTokenizer) -> None:
    deltas = run(tokenizer, HERMES_TWO_CALLS, replace(AUTO, choice=ToolChoiceMode.NONE))
    assert "".join(d.text for d in deltas) == HERMES_TWO_CALLS
    assert deltas[-1].finish_reason == "stop"


@pytest.mark.parametrize("chunk", [1, 1000])
def test_a_named_call_streams_its_arguments(tokenizer: ModelTokenizer, chunk: int) -> None:
    named = replace(AUTO, choice=ToolChoiceMode.FUNCTION, function_name="get_weather")
    deltas = run(tokenizer, '{"city": "Lyon"}', named, chunk=chunk)
    assert calls_of(deltas) == [("call_0", "get_weather", '{"city": "Lyon"}')]
    assert deltas[0].tool_calls[0].id == "call_0" and deltas[0].tool_calls[0].name
    if chunk == 1:
        assert len([d for d in deltas if d.tool_calls]) > 2  # fragments, as they come
    assert all(not d.text for d in deltas)
    assert deltas[-1].finish_reason == "tool_calls"


def test_a_required_choice_reads_the_json_list(tokenizer: ModelTokenizer) -> None:
    required = replace(AUTO, choice=ToolChoiceMode.REQUIRED)
    text = (
        '[{"name": "get_time", "arguments": {}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    )
    deltas = run(tokenizer, text, required, parser="mistral")
    assert calls_of(deltas) == [
        ("call_0", "get_time", "{}"),
        ("call_1", "get_weather", '{"city": "Rome"}'),
    ]
    assert deltas[-1].finish_reason == "tool_calls"


# ---- OpenAI shapes ------------------------------------------------------------------------


def builder() -> ResponseBuilder:
    return ResponseBuilder(chat=True, request_id="r", model="m", token_text=str)


def test_a_response_lists_the_calls_with_null_content() -> None:
    build = builder()
    build.add(OutputDelta("", tool_calls=(ToolCallDelta(0, "call_a", "f", '{"x"'),)))
    build.add(
        OutputDelta(
            "", tool_calls=(ToolCallDelta(0, arguments=": 1}"),), finish_reason="tool_calls"
        )
    )
    choice = build.response()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        ],
    }


def test_a_stream_sends_openai_call_pieces() -> None:
    build = builder()
    first = build.chunks(OutputDelta("", tool_calls=(ToolCallDelta(0, "call_a", "f", ""),)))
    later = build.chunks(OutputDelta("", tool_calls=(ToolCallDelta(0, arguments="{}"),)))
    last = build.chunks(OutputDelta("", finish_reason="tool_calls"))
    assert first[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "tool_calls": [
            {
                "index": 0,
                "id": "call_a",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ],
    }
    assert later[0]["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]
    }
    assert last[0]["choices"][0]["finish_reason"] == "tool_calls"


def test_tools_go_into_the_system_message_when_the_template_has_no_place_for_them() -> None:
    template = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    tools_template = ChatTemplate("{{ tools | tojson }}{{ messages[0].content }}")
    assert not template.reads_tools and tools_template.reads_tools
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = template.render(
        [ChatMessage("system", "Be brief."), ChatMessage("user", "hi")], tools=tools
    )
    assert text.startswith("[system] Be brief.\n\nYou can call these functions")
    assert '{"type": "function", "function": {"name": "f"}}' in text and "[user] hi" in text
    text = template.render([ChatMessage("user", "hi")], tools=tools)
    assert text.startswith("[system] You can call these functions")
    assert tools_template.render([ChatMessage("user", "hi")], tools=tools).startswith('[{"type"')


@pytest.mark.parametrize(
    ("parser", "call"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ARGS}\n</tool_call>'),
        ("json", '{"name": "get_weather", "arguments": ARGS}'),
        ("llama3_json", '{"name": "get_weather", "parameters": ARGS}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ARGS}]'),
    ],
)
def test_strict_tools_hold_auto_calls_to_their_schemas(
    tokenizer: ModelTokenizer, parser: str, call: str
) -> None:
    """Free text passes; a call in the family's syntax passes with valid arguments only."""
    import xgrammar as xgr

    from services.common.grammar import GrammarCompiler
    from services.tokenizer.tool_request import strict_call_grammar

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = ToolRequest((FunctionTool("get_weather", parameters=schema, strict=True),))
    grammar = strict_call_grammar(tools, parser)
    assert grammar is not None and grammar.kind is StructuredOutputKind.STRUCTURAL_TAG
    assert strict_call_grammar(replace(tools, tools=(FunctionTool("f"),)), parser) is None
    assert strict_call_grammar(replace(tools, choice=ToolChoiceMode.REQUIRED), parser) is None
    compiled = GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size, (2,)).compile(
        grammar
    )

    def accepts(text: str) -> bool:
        return bool(xgr.GrammarMatcher(compiled).accept_string(text))

    assert accepts("Let me check. " + call.replace("ARGS", '{"city":"Paris"}'))
    assert not accepts("Let me check. " + call.replace("ARGS", '{"city":5}'))
    assert not accepts(call.replace("ARGS", '{"town":"Paris"}'))
