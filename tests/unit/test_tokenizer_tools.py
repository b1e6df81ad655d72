"""Tool calling through the tokenizer tier's two doors, on the embedded model's real tokenizer
and a scripted scheduler whose answer is written in the Hermes call syntax: the official
`openai` client (streaming and not) and a gRPC client get the same calls; a forced choice
reaches the scheduler as a grammar; a tool-calling history renders through the template."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from openai import OpenAI

from protos.llmserve.v1 import text_pb2
from services.tokenizer.server import ServedModel
from tests.unit.tokenizer_tier_harness import (
    FakeEngine,
    run,
    running_stack,
    script_for,
    served_model,
)

OUTPUT = (
    'I will look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call><tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
HERMES_TEMPLATE = str(Path(__file__).parents[1] / "templates" / "hermes_tools.jinja")


@pytest.fixture(scope="module")
def model() -> ServedModel:
    # Tool schemas take room: a context longer than the harness's short one.
    served = served_model()
    return replace(served, description=replace(served.description, max_model_len=1024))


def engine_for(model: ServedModel, text: str = OUTPUT, finish_reason: str = "stop") -> FakeEngine:
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    return FakeEngine(script_for(ids, chunk=2, finish_reason=finish_reason))


def openai_calls(base_url: str, stream: bool, **fields: Any) -> tuple[str, list[Any], str]:
    """(content, [(name, arguments)], finish_reason) from the official client."""
    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    request: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
        "tools": [WEATHER, TIME],
        **fields,
    }
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [
            (c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls or ()
        ]
        ids = [c.id for c in choice.message.tool_calls or ()]
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
        return choice.message.content or "", calls, choice.finish_reason
    content, finish = "", ""
    pieces: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = pieces.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            if piece.id:
                assert not call["id"], "a call's id comes once"
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(pieces.items())]
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_gets_the_calls(model: ServedModel, stream: bool) -> None:
    engine = engine_for(model)

    async def scenario() -> None:
        async with running_stack(model, [engine], chat_template=HERMES_TEMPLATE) as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1"
            content, calls, finish = await asyncio.to_thread(openai_calls, url, stream)
        assert calls == EXPECTED
        assert content == "I will look."
        assert finish == "tool_calls"
        # Auto: no grammar; the tools reached the prompt through the template.
        submitted = engine.requests[0]
        assert not submitted.sampling.HasField("structured_output")
        prompt = model.tokenizer.decode(list(submitted.prompt_token_ids), skip_special_tokens=False)
        assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt

    run(scenario)


def test_choice_none_leaves_the_syntax_as_text(model: ServedModel) -> None:
    engine = engine_for(model)

    async def scenario() -> None:
        async with running_stack(model, [engine], chat_template=HERMES_TEMPLATE) as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1"
            content, calls, finish = await asyncio.to_thread(
                openai_calls, url, False, tool_choice="none"
            )
        assert (content, calls, finish) == (OUTPUT, [], "stop")

    run(scenario)


def test_a_forced_call_reaches_the_scheduler_as_a_grammar(model: ServedModel) -> None:
    engine = engine_for(model, '{"city": "Oslo"}')

    async def scenario() -> None:
        async with running_stack(model, [engine], chat_template=HERMES_TEMPLATE) as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1"
            named = {"type": "function", "function": {"name": "get_weather"}}
            content, calls, finish = await asyncio.to_thread(
                openai_calls, url, True, tool_choice=named
            )
        assert (content, calls, finish) == ("", [("get_weather", {"city": "Oslo"})], "tool_calls")
        grammar = engine.requests[0].sampling.structured_output
        assert json.loads(grammar.json_schema) == WEATHER["function"]["parameters"]  # type: ignore[index]

    run(scenario)


def test_grpc_gets_the_same_calls(model: ServedModel) -> None:
    engine = engine_for(model)
    tools = [
        text_pb2.Tool(name="get_weather", parameters=json.dumps(WEATHER["function"]["parameters"])),  # type: ignore[index]
        text_pb2.Tool(name="get_time"),
    ]

    async def scenario() -> None:
        async with running_stack(model, [engine], chat_template=HERMES_TEMPLATE) as stack:
            responses = await stack.generate(
                text_pb2.GenerateRequest(
                    messages=[text_pb2.ChatMessage(role="user", content="Weather?")], tools=tools
                )
            )
        pieces: dict[int, list[str]] = {}
        for response in responses:
            for piece in response.tool_calls:
                call = pieces.setdefault(piece.index, ["", ""])
                call[0] += piece.name
                call[1] += piece.arguments
        calls = [(name, json.loads(arguments)) for name, arguments in pieces.values()]
        assert calls == EXPECTED
        assert "".join(r.text for r in responses) == "I will look."
        assert responses[-1].finish_reason == "tool_calls"

    run(scenario)


def test_grpc_refuses_bad_tools_by_name(model: ServedModel) -> None:
    async def scenario() -> None:
        async with running_stack(model, [FakeEngine()]) as stack:
            chat = [text_pb2.ChatMessage(role="user", content="x")]
            cases = [
                ([text_pb2.Tool(name="f", parameters="[1")], None, "tools[0].parameters"),
                ([text_pb2.Tool(name="f", parameters="[1]")], None, "tools[0].parameters"),
                ([text_pb2.Tool(name="no spaces")], None, "tools[0].name"),
                (
                    [text_pb2.Tool(name="f")],
                    text_pb2.ToolChoice(mode=text_pb2.ToolChoice.FUNCTION, function_name="g"),
                    "tool_choice",
                ),
                ([], text_pb2.ToolChoice(mode=text_pb2.ToolChoice.REQUIRED), "tool_choice"),
            ]
            for tools, choice, field in cases:
                request = text_pb2.GenerateRequest(messages=chat, tools=tools)
                if choice is not None:
                    request.tool_choice.CopyFrom(choice)
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stack.generate(request)
                assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                details = raised.value.details() or ""
                assert details.startswith(field), (field, details)

    run(scenario)


def test_a_tool_calling_history_renders_through_the_template(model: ServedModel) -> None:
    engine = engine_for(model, "It is 18 C in Paris.")

    async def scenario() -> None:
        async with running_stack(model, [engine], chat_template=HERMES_TEMPLATE) as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1"
            call = {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
            history = [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            ]
            content, calls, finish = await asyncio.to_thread(
                openai_calls, url, False, messages=history
            )
        assert (content, calls, finish) == ("It is 18 C in Paris.", [], "stop")
        prompt = model.tokenizer.decode(
            list(engine.requests[0].prompt_token_ids), skip_special_tokens=False
        )
        assert prompt.endswith(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )

    run(scenario)


def test_a_template_without_tools_gets_them_in_the_system_message(model: ServedModel) -> None:
    """The embedded model's template has no place for tools: they go into the system message
    as text, and the answer's syntax (told from the template) is plain JSON."""
    engine = engine_for(model, '{"name": "get_time", "arguments": {"zone": "UTC"}}')

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1"
            content, calls, finish = await asyncio.to_thread(openai_calls, url, False)
        assert (content, calls, finish) == ("", [("get_time", {"zone": "UTC"})], "tool_calls")
        prompt = model.tokenizer.decode(
            list(engine.requests[0].prompt_token_ids), skip_special_tokens=False
        )
        assert "You can call these functions" in prompt and '"name": "get_weather"' in prompt

    run(scenario)


def test_strict_tools_under_auto_send_a_structural_tag(model: ServedModel) -> None:
    engine = engine_for(model)
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}  # type: ignore[dict-item]

    async def scenario() -> None:
        async with running_stack(model, [engine], chat_template=HERMES_TEMPLATE) as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1/chat/completions"
            body = {
                "model": model.name,
                "messages": [{"role": "user", "content": "Weather?"}],
                "tools": [strict, TIME],
            }
            answer = await asyncio.to_thread(httpx.post, url, json=body, timeout=10)
            both = {**body, "response_format": {"type": "json_object"}}
            refused = await asyncio.to_thread(httpx.post, url, json=both, timeout=10)
        assert answer.status_code == 200, answer.text
        tag = json.loads(engine.requests[0].sampling.structured_output.structural_tag)
        assert tag["format"]["triggers"] == ["<tool_call>"]
        schemas = [t["content"]["json_schema"] for t in tag["format"]["tags"]]
        assert schemas == [WEATHER["function"]["parameters"], {"type": "object"}]  # type: ignore[index]
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "tools"

    run(scenario)
