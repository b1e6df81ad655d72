"""The Anthropic Messages API door of the tokenizer tier, driven by the official `anthropic`
client over real HTTP, on the embedded model's real tokenizer and a scripted scheduler: text,
the stream's events in order, stop sequences, usage, tool use both ways, keys and tenants,
refusals in Anthropic's shape, count_tokens."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import pytest

from services.common.prefix_hash import tenant_salt
from services.tokenizer.server import ServedModel
from tests.unit.tokenizer_tier_harness import (
    FakeEngine,
    Stack,
    run,
    running_stack,
    script_for,
    served_model,
)

KEY = "sk-test-key"
USER = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


HERMES_TEMPLATE = str(Path(__file__).parents[1] / "templates" / "hermes_tools.jinja")


@pytest.fixture(scope="module")
def model() -> ServedModel:
    # Tool schemas take room: a context longer than the harness's short one.
    served = served_model()
    return replace(served, description=replace(served.description, max_model_len=1024))


def engine_saying(model: ServedModel, text: str, finish_reason: str = "stop") -> FakeEngine:
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    return FakeEngine(script_for(ids, chunk=2, finish_reason=finish_reason, num_cached_tokens=4))


def base_url(stack: Stack) -> str:
    assert stack.server.http is not None
    return f"http://127.0.0.1:{stack.server.http.port}"


def client(stack: Stack, api_key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url(stack), api_key=api_key, max_retries=0)


def test_text_whole_and_streamed_with_usage(model: ServedModel) -> None:
    engine = engine_saying(model, "Hello there!")

    async def scenario() -> None:
        async with running_stack(model, [engine], api_key=(KEY,)) as stack:
            api = client(stack)
            message = await api.messages.create(
                model=model.name, max_tokens=16, messages=USER, system="Be brief."
            )
            raw = await api.messages.create(
                model=model.name, max_tokens=16, messages=USER, stream=True
            )
            events = [event async for event in raw]
            async with api.messages.stream(
                model=model.name, max_tokens=16, messages=USER
            ) as stream:
                final = await stream.get_final_message()
        assert message.id.startswith("msg_") and message.role == "assistant"
        assert [block.type for block in message.content] == ["text"]
        assert message.content[0].text == "Hello there!"  # type: ignore[union-attr]
        assert message.stop_reason == "end_turn" and message.stop_sequence is None
        num_output = len(model.tokenizer.encode("Hello there!", add_special_tokens=False))
        prompt = engine.requests[0].prompt_token_ids
        assert message.usage.output_tokens == num_output
        # Anthropic's split: the cached prompt tokens apart from the rest.
        assert message.usage.cache_read_input_tokens == 4
        assert message.usage.input_tokens == len(prompt) - 4

        assert [event.type for event in events] == [
            "message_start",
            "content_block_start",
            *["content_block_delta"] * (len(events) - 5),
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        assert len(events) > 6  # the text came in several deltas
        assert events[0].message.usage.input_tokens == len(engine.requests[1].prompt_token_ids) - 4
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        assert text == "Hello there!"
        assert events[-2].delta.stop_reason == "end_turn"
        assert events[-2].usage.output_tokens == num_output
        assert [(block.type, block.text) for block in final.content] == [  # type: ignore[union-attr]
            ("text", "Hello there!")
        ]
        assert final.usage.output_tokens == num_output

    run(scenario)


def test_a_stop_sequence_ends_the_answer_and_is_named(model: ServedModel) -> None:
    engine = engine_saying(model, "One, two, three, four")

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            api = client(stack)
            message = await api.messages.create(
                model=model.name, max_tokens=16, messages=USER, stop_sequences=["three", "zzz"]
            )
            raw = await api.messages.create(
                model=model.name,
                max_tokens=16,
                messages=USER,
                stop_sequences=["three"],
                stream=True,
            )
            events = [event async for event in raw]
        assert message.content[0].text == "One, two, "  # type: ignore[union-attr]
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "three")
        delta = events[-2]
        assert delta.type == "message_delta"
        assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", "three")

    run(scenario)


def test_max_tokens_and_sampling_reach_the_scheduler(model: ServedModel) -> None:
    engine = engine_saying(model, "a b c", finish_reason="length")

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            message = await client(stack).messages.create(
                model=model.name,
                max_tokens=len(model.tokenizer.encode("a b c", add_special_tokens=False)),
                messages=USER,
                extra_body={"temperature": 0.25, "top_p": 0.5, "top_k": 7},
            )
        assert message.stop_reason == "max_tokens"
        sampling = engine.requests[0].sampling
        assert sampling.temperature == pytest.approx(0.25)
        assert sampling.top_p == pytest.approx(0.5)
        assert sampling.top_k == 7
        assert sampling.max_new_tokens == message.usage.output_tokens

    run(scenario)


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_tool_use_round_trip(model: ServedModel) -> None:
    calling = engine_saying(model, HERMES_CALL)

    async def scenario() -> None:
        async with running_stack(model, [calling], chat_template=HERMES_TEMPLATE) as stack:
            api = client(stack)
            message = await api.messages.create(
                model=model.name, max_tokens=64, messages=USER, tools=[WEATHER]
            )
            raw = await api.messages.create(
                model=model.name, max_tokens=64, messages=USER, tools=[WEATHER], stream=True
            )
            events = [event async for event in raw]
            async with api.messages.stream(
                model=model.name, max_tokens=64, messages=USER, tools=[WEATHER]
            ) as stream:
                final = await stream.get_final_message()
            # The call goes back with its result; the answer is text again.
            calling.script = engine_saying(model, "It is 18°C in Paris.").script
            answer = await api.messages.create(
                model=model.name,
                max_tokens=64,
                tools=[WEATHER],
                messages=[
                    *USER,
                    {"role": "assistant", "content": message.content},
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": message.content[0].id,  # type: ignore[union-attr]
                                "content": "18°C",
                            }
                        ],
                    },
                ],
            )
        [call] = message.content
        assert call.type == "tool_use"
        assert call.id.startswith("toolu_")
        assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
        assert message.stop_reason == "tool_use"

        types = [event.type for event in events]
        assert types == [
            "message_start",
            "content_block_start",
            *["content_block_delta"] * (len(types) - 5),
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        block = events[1].content_block
        assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {})
        fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
        assert json.loads("".join(fragments)) == {"city": "Paris"}
        assert events[-2].delta.stop_reason == "tool_use"
        assert final.content[0].type == "tool_use"
        assert final.content[0].input == {"city": "Paris"}  # type: ignore[union-attr]

        assert answer.content[0].text == "It is 18°C in Paris."  # type: ignore[union-attr]
        assert answer.stop_reason == "end_turn"
        # The history reached the template: the call and its result are in the prompt.
        prompt = model.tokenizer.decode(list(calling.requests[-1].prompt_token_ids))
        assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
        assert "<tool_response>\n18°C\n</tool_response>" in prompt

    run(scenario)


@pytest.mark.parametrize(
    ("tool_choice", "output"),
    [
        ({"type": "any"}, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
        ({"type": "tool", "name": "get_weather"}, '{"city": "Oslo"}'),
    ],
)
def test_a_forced_tool_choice_is_a_grammar_and_a_call(
    model: ServedModel, tool_choice: dict[str, Any], output: str
) -> None:
    engine = engine_saying(model, output)

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            message = await client(stack).messages.create(
                model=model.name,
                max_tokens=64,
                messages=USER,
                tools=[WEATHER],
                tool_choice=tool_choice,  # type: ignore[arg-type]
            )
        [call] = message.content
        assert call.type == "tool_use"
        assert (call.name, call.input) == ("get_weather", {"city": "Oslo"})
        assert message.stop_reason == "tool_use"
        # The scheduler got the grammar that makes the answer a valid call.
        assert engine.requests[0].sampling.HasField("structured_output")

    run(scenario)


def test_thinking_blocks_with_a_reasoning_parser(model: ServedModel) -> None:
    engine = engine_saying(model, "<think>\nThe user greets me.\n</think>\n\nHello!")

    async def scenario() -> None:
        async with running_stack(model, [engine], reasoning_parser="qwen3") as stack:
            message = await client(stack).messages.create(
                model=model.name,
                max_tokens=64,
                messages=USER,
                thinking={"type": "enabled", "budget_tokens": 1024},
            )
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking.strip() == "The user greets me."  # type: ignore[union-attr]
        assert message.content[1].text == "Hello!"  # type: ignore[union-attr]

    run(scenario)


def test_keys_by_x_api_key_or_bearer_and_tenants(model: ServedModel, tmp_path: Path) -> None:
    engine = engine_saying(model, "Hi")
    key_file = tmp_path / "keys"
    key_file.write_text(f"{KEY}\nsk-acme tenant=acme\n")

    async def scenario() -> None:
        async with running_stack(model, [engine], api_key_file=str(key_file)) as stack:
            url = base_url(stack) + "/v1/messages"
            body = {"model": model.name, "max_tokens": 4, "messages": USER}
            async with httpx.AsyncClient(timeout=10) as http:
                missing = await http.post(url, json=body)
                bearer = await http.post(url, json=body, headers={"authorization": f"Bearer {KEY}"})
                acme = await http.post(url, json=body, headers={"x-api-key": "sk-acme"})
            with pytest.raises(anthropic.AuthenticationError) as wrong:
                await client(stack, api_key="sk-wrong").messages.create(**body)
        assert missing.status_code == 401
        assert missing.json() == {
            "type": "error",
            "error": {
                "type": "authentication_error",
                "message": missing.json()["error"]["message"],
            },
            "request_id": missing.headers["request-id"],
        }
        assert "x-api-key" in missing.json()["error"]["message"]
        assert wrong.value.status_code == 401
        assert wrong.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        assert bearer.status_code == 200 and acme.status_code == 200
        # A tenant-bound key's requests use its tenant's prefix cache.
        assert engine.requests[0].cache_salt == b""
        assert engine.requests[1].cache_salt == tenant_salt("acme")

    run(scenario)


REFUSED = [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"temperature": 2}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].type",
    ),
    # An empty final assistant message is no prefill: here, nothing is left to answer.
    ({"messages": [{"role": "assistant", "content": ""}]}, "messages"),
]


def test_refusals_are_400_or_404_naming_the_field(model: ServedModel) -> None:
    engine = engine_saying(model, "Hi")

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            api = client(stack)
            for fields, param in REFUSED:
                with pytest.raises(anthropic.BadRequestError) as raised:
                    # extra_body: the client has no arguments for fields it does not know.
                    await api.messages.create(
                        model=model.name, max_tokens=4, messages=USER, extra_body=fields
                    )
                error = raised.value.body["error"]  # type: ignore[index]
                assert error["type"] == "invalid_request_error"
                assert error["message"].startswith(f"{param}: "), error
            with pytest.raises(anthropic.NotFoundError) as unknown:
                await api.messages.create(model="claude-x", max_tokens=4, messages=USER)
        assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        assert not engine.requests  # all refused before the scheduler

    run(scenario)


def test_a_stream_that_fails_midway_ends_with_an_error_event(model: ServedModel) -> None:
    ids = model.tokenizer.encode("Hello there", add_special_tokens=False)
    engine = FakeEngine(
        script_for(ids, finish_reason=""),
        fail_after_script=(grpc.StatusCode.UNAVAILABLE, "worker gone"),
    )

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            body = {"model": model.name, "max_tokens": 16, "messages": USER, "stream": True}
            async with httpx.AsyncClient(timeout=10) as http:
                response = await http.post(base_url(stack) + "/v1/messages", json=body)
        assert response.status_code == 200
        events = sse_events(response.text)
        assert [name for name, _ in events][:2] == ["message_start", "content_block_start"]
        name, data = events[-1]
        assert name == "error" and data["type"] == "error"
        assert data["error"]["type"] == "overloaded_error"
        assert "message_stop" not in [name for name, _ in events]

    run(scenario)


def test_a_client_that_goes_away_cancels_the_scheduler_call(model: ServedModel) -> None:
    ids = model.tokenizer.encode("one two", add_special_tokens=False)
    engine = FakeEngine(script_for(ids, finish_reason=""), hold_open=True)

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            body = {"model": model.name, "max_tokens": 64, "messages": USER}
            # Streaming: the client closes the stream after the first events.
            raw = await client(stack).messages.create(**body, stream=True)
            async for event in raw:
                assert event.type == "message_start"
                break
            await raw.close()
            await asyncio.wait_for(engine.cancelled.wait(), 10)
            # Whole: the client stops waiting for the answer.
            engine.cancelled.clear()
            async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=0.5)) as http:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(base_url(stack) + "/v1/messages", json=body)
            await asyncio.wait_for(engine.cancelled.wait(), 10)

    run(scenario)


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for frame in text.strip().split("\n\n"):
        name_line, data_line = frame.split("\n")
        events.append((name_line.removeprefix("event: "), json.loads(data_line[len("data: ") :])))
    return events


def test_count_tokens_is_the_templated_prompt(model: ServedModel) -> None:
    engine = engine_saying(model, "Hi")

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            api = client(stack)
            counted = await api.messages.count_tokens(
                model=model.name, messages=USER, system="Be brief."
            )
            with_tools = await api.messages.count_tokens(
                model=model.name, messages=USER, system="Be brief.", tools=[WEATHER]
            )
            for tools in ([], [WEATHER]):
                await api.messages.create(
                    model=model.name, max_tokens=4, messages=USER, system="Be brief.", tools=tools
                )
            with pytest.raises(anthropic.BadRequestError) as raised:
                await api.messages.count_tokens(
                    model=model.name, messages=USER, extra_body={"max_tokens": 4}
                )
        # The prompts /v1/messages sent for the same conversations, tools included.
        assert counted.input_tokens == len(engine.requests[0].prompt_token_ids)
        assert with_tools.input_tokens == len(engine.requests[1].prompt_token_ids)
        assert with_tools.input_tokens > counted.input_tokens
        assert raised.value.body["error"]["message"].startswith("max_tokens")  # type: ignore[index]

    run(scenario)
