"""Open Responses bodies → the chat pipeline's input, and the in-memory store (pure)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.cache_keys import stored_response_key
from services.contracts.errors import InvalidRequestError
from services.tokenizer.http.openai.responses_api import body as responses_body
from services.tokenizer.http.openai.responses_api.store import MemoryResponseStore, StoredResponse


def parsed(**fields: object) -> responses_body.ResponsesBody:
    return responses_body.parse(json.dumps({"model": "m", **fields}).encode())


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": "x", "temprature": 1}, "temprature"),
        ({"input": 3}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ],
)
def test_a_bad_field_is_named(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        parsed(**fields)
    assert error.value.field == param


def test_items_become_chat_messages_with_calls_and_results() -> None:
    body = parsed(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            {"type": "reasoning", "summary": []},
        ],
        tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "w"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        max_output_tokens=7,
    )
    generate = responses_body.generate_input(body, responses_body.input_items(body), "resp_1", 100)
    roles = [message.role for message in generate.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert [call.id for call in generate.messages[2].tool_calls] == ["c1", "c2"]
    assert generate.messages[3].tool_call_id == "c1"
    assert generate.sampling.max_new_tokens == 7
    assert generate.tool_request is not None and generate.tool_request.function_name == "w"
    assert generate.sampling.structured_output is not None


def test_json_schema_needs_its_schema() -> None:
    body = parsed(input="x", text={"format": {"type": "json_schema", "name": "x"}})
    with pytest.raises(InvalidRequestError) as error:
        responses_body.generate_input(body, responses_body.input_items(body), "r", 10)
    assert error.value.field == "text.format.schema"


def test_memory_store_is_per_owner_and_bounded() -> None:
    async def run() -> None:
        store = MemoryResponseStore(max_responses=2)
        for index in range(3):
            await store.put("a", StoredResponse({"id": f"resp_{index}"}, []))
        assert await store.get("a", "resp_0") is None  # the oldest went first
        assert await store.get("a", "resp_2") is not None
        assert await store.get("b", "resp_2") is None
        assert not await store.delete("b", "resp_2")
        assert await store.delete("a", "resp_2")
        assert await store.get("a", "resp_2") is None

    asyncio.run(run())


def test_redis_keys_never_collide_across_owners() -> None:
    assert stored_response_key("tenant:a", "resp_1") != stored_response_key("tenant:b", "resp_1")
    assert "*" not in stored_response_key("key:x", "resp_*")
