"""Tool calling on a real stack (`llmserve up`, the embedded model), driven by the official
`openai` client and a gRPC client: tool_choice required, a named function, none and auto;
parallel calls; a full round trip (call → tool result → answer) rendered through the model's
template; sampled forced calls whose arguments always follow their tool's schema; streamed
pieces that join into the same calls as the whole answer."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(exact_stack: RunningStack) -> RunningStack:
    """Exact fp32 (`gguf-exact`): a request served from the prefix cache gives the same greedy
    answer as the first time, so a stream can be compared with the whole answer (the gguf
    default's fp16 KV cache rounds cached keys, and the embedded model's tokens can be near
    ties)."""
    return exact_stack


# Bounded strings and enums: a sampled answer always fits max_tokens, so a forced call is
# never cut short (a cut call is a "length" finish, not an invalid one, but would not test).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}  # type: ignore[index]
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
MAX_TOKENS = 120


def client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=300)


def model_name(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])


def ask(stack: RunningStack, **fields: Any) -> Any:
    request: dict[str, Any] = {
        "model": model_name(stack),
        "messages": QUESTION,
        "tools": TOOLS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **fields,
    }
    return client(stack).chat.completions.create(**request).choices[0]


def calls_of(choice: Any) -> list[tuple[str, dict[str, Any]]]:
    return [
        (call.function.name, json.loads(call.function.arguments))
        for call in choice.message.tool_calls or ()
    ]


def streamed(stack: RunningStack, **fields: Any) -> tuple[str, list[Any], str]:
    """(content, calls, finish_reason) of a stream, its call pieces joined as a client would."""
    request: dict[str, Any] = {
        "model": model_name(stack),
        "messages": QUESTION,
        "tools": TOOLS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        **fields,
    }
    content, finish = "", ""
    pieces: dict[int, dict[str, str]] = {}
    for chunk in client(stack).chat.completions.create(**request):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = pieces.setdefault(piece.index, {"name": "", "arguments": ""})
            if piece.id:
                call["name"] = piece.function.name
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(pieces.items())]
    return content, calls, finish


def test_required_calls_always_follow_their_schemas(stack: RunningStack) -> None:
    """20 sampled runs (seeded): every one is a call to a given tool with valid arguments."""

    def run(seed: int) -> Any:
        return ask(stack, tool_choice="required", temperature=1.0, seed=seed)

    # All 20 in flight at once: one batch (--max-num-seqs 32) takes the steps of its longest
    # answer, where waves of a few would each take theirs.
    with ThreadPoolExecutor(20) as pool:
        choices = list(pool.map(run, range(20)))
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = calls_of(choice)
        assert calls
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
        ids = [call.id for call in choice.message.tool_calls]
        assert len(set(ids)) == len(ids)


def test_one_call_when_parallel_calls_are_off(stack: RunningStack) -> None:
    def run(seed: int) -> Any:
        return ask(
            stack, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed
        )

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(run, range(4)))
    for choice in choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1


def test_a_named_function_is_called_and_streams_the_same(stack: RunningStack) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = ask(stack, tool_choice=named)
    [(name, arguments)] = calls_of(choice)
    assert name == "get_weather"
    jsonschema.validate(arguments, SCHEMAS["get_weather"])
    assert choice.message.content is None
    assert streamed(stack, tool_choice=named) == ("", calls_of(choice), "tool_calls")
    required = ask(stack, tool_choice="required")
    assert streamed(stack, tool_choice="required") == ("", calls_of(required), "tool_calls")


def test_choice_none_answers_in_text(stack: RunningStack) -> None:
    choice = ask(stack, tool_choice="none", max_tokens=24)
    assert choice.message.tool_calls is None
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_reads_calls_in_the_models_syntax(stack: RunningStack) -> None:
    """The embedded model's template has no place for tools, so its call syntax is plain JSON
    (one object or a list). A regex makes the model write one call, then two."""
    one = '\\{"name": "get_weather", "arguments": \\{"city": "Paris", "unit": "celsius"\\}\\}'
    choice = ask(stack, extra_body={"guided_regex": one})
    assert calls_of(choice) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert choice.finish_reason == "tool_calls"
    two = f'\\[{one}, \\{{"name": "add", "arguments": \\{{"a": 2, "b": 3\\}}\\}}\\]'
    choice = ask(stack, extra_body={"guided_regex": two})
    assert calls_of(choice) == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("add", {"a": 2, "b": 3}),
    ]
    assert streamed(stack, extra_body={"guided_regex": two}) == ("", calls_of(choice), "tool_calls")
    # Left to itself the model answers in text or calls; either way a well-formed answer.
    free = ask(stack, max_tokens=32)
    assert free.finish_reason in ("stop", "length", "tool_calls")
    assert free.message.content or free.message.tool_calls


def test_a_round_trip_through_the_template(stack: RunningStack) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = ask(stack, tool_choice=named)
    [call] = first.message.tool_calls
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    api = client(stack)
    answer = api.chat.completions.create(
        model=model_name(stack), messages=history, tools=TOOLS, max_tokens=24, temperature=0
    )
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None
    # The result is in the prompt: its tokens are counted.
    plain = api.chat.completions.create(
        model=model_name(stack), messages=QUESTION, tools=TOOLS, max_tokens=1
    )
    assert plain.usage is not None
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 10


def test_grpc_gets_the_calls_http_gets(stack: RunningStack) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    expected = calls_of(ask(stack, tool_choice=named))
    request = text_pb2.GenerateRequest(
        messages=[text_pb2.ChatMessage(role="user", content=QUESTION[0]["content"])],
        sampling=text_pb2.SamplingParams(temperature=0, max_new_tokens=MAX_TOKENS),
        tools=[
            text_pb2.Tool(
                name=tool["function"]["name"],  # type: ignore[index]
                description=tool["function"]["description"],  # type: ignore[index]
                parameters=json.dumps(tool["function"]["parameters"]),  # type: ignore[index]
            )
            for tool in TOOLS
        ],
        tool_choice=text_pb2.ToolChoice(mode=text_pb2.ToolChoice.FUNCTION, function_name="add"),
    )
    responses = list(stack.text_stub().Generate(request, timeout=120))
    names = "".join(p.name for r in responses for p in r.tool_calls)
    arguments = "".join(p.arguments for r in responses for p in r.tool_calls)
    assert [(names, json.loads(arguments))] == expected
    assert responses[-1].finish_reason == "tool_calls"


def test_the_chat_command_shows_the_calls(stack: RunningStack, tmp_path: Path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    command = [
        sys.executable, "-m", "services.cli", "chat", QUESTION[0]["content"],
        "--target", stack.public, "--tools", str(tools), "--tool-choice", "get_weather",
        "--temperature", "0", "--max-new-tokens", str(MAX_TOKENS),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("[tool call]")]
    name, _, arguments = line.removeprefix("[tool call] ").partition("(")
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments.removesuffix(")")), SCHEMAS["get_weather"])
    assert "[tool_calls]" in done.stderr


ORDER = {
    "type": "function",
    "function": {
        "name": "order",
        "description": "Order items",
        "parameters": {
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 2}
            },
            "required": ["items"],
            "additionalProperties": False,
            "$defs": {
                "Item": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 8}},
                    "required": ["sku"],
                    "additionalProperties": False,
                }
            },
        },
    },
}


def test_required_choice_serves_tools_with_local_defs(stack: RunningStack) -> None:
    # Refused with 400 "Cannot find field $defs" before the definitions moved to the root.
    choice = ask(stack, tools=[ORDER, ADD], tool_choice="required")
    assert choice.finish_reason in ("tool_calls", "length")
    if choice.finish_reason == "tool_calls":
        for name, arguments in calls_of(choice):
            schema = ORDER["function"]["parameters"] if name == "order" else SCHEMAS["add"]  # type: ignore[index]
            jsonschema.validate(arguments, schema)
