"""The Open Responses door (`/v1/responses`) on a real stack, driven by the official `openai`
client: a whole answer and a stream, structured output, a tool round trip (function_call →
function_call_output → answer), `previous_response_id`, retrieve and delete, stored responses
scoped per tenant, and errors in the spec's shape."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.stack import RunningStack, running_stack
from tests.e2e.conftest import STACK_FLAGS, STARTUP_TIMEOUT_S
from tests.e2e.llm_comply import SHORT_CONTEXT_FLAGS, assert_group_passes

pytestmark = pytest.mark.slow

TENANT_A_KEY = "sk-responses-tenant-a"
TENANT_B_KEY = "sk-responses-tenant-b"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def stack() -> Iterator[RunningStack]:
    with tempfile.TemporaryDirectory(prefix="llmserve-responses-") as name:
        key_file = Path(name) / "keys.txt"
        key_file.write_text(f"{TENANT_A_KEY} tenant=tenant-a\n{TENANT_B_KEY} tenant=tenant-b\n")
        # A short context for llm-comply (tests/e2e/llm_comply.py says why).
        flags = [*STACK_FLAGS, "--api-key-file", str(key_file), *SHORT_CONTEXT_FLAGS]
        with running_stack(flags, startup_timeout_s=STARTUP_TIMEOUT_S) as running:
            yield running
        assert running.returncode == 0


def client(stack: RunningStack, key: str = TENANT_A_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http, api_key=key, max_retries=0, timeout=300)


def model_name(stack: RunningStack) -> str:
    headers = {"Authorization": f"Bearer {TENANT_A_KEY}"}
    return str(
        httpx.get(f"{stack.http}/models", headers=headers, timeout=10).json()["data"][0]["id"]
    )


def test_a_whole_answer_is_a_response_object(stack: RunningStack) -> None:
    response = client(stack).responses.create(
        model=model_name(stack),
        input="Say hello.",
        instructions="Answer briefly.",
        max_output_tokens=8,
        temperature=0,
        metadata={"case": "whole"},
    )
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output[0].type == "message"
    assert response.output_text
    assert response.metadata == {"case": "whole"}
    assert response.usage is not None
    assert 0 < response.usage.output_tokens <= 8
    assert response.usage.total_tokens == response.usage.input_tokens + 8 or (
        response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    )


def test_max_output_tokens_makes_an_incomplete_response(stack: RunningStack) -> None:
    response = client(stack).responses.create(
        model=model_name(stack),
        input="Count from one to one hundred in words.",
        max_output_tokens=3,
        temperature=0,
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


def test_a_stream_follows_the_event_lifecycle(stack: RunningStack) -> None:
    events = list(
        client(stack).responses.create(
            model=model_name(stack),
            input="Say hello.",
            max_output_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        kinds[-1],
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text and text == done.text
    final = events[-1].response
    assert final.output_text == text
    # The same greedy answer, whole.
    whole = client(stack).responses.create(
        model=model_name(stack), input="Say hello.", max_output_tokens=8, temperature=0
    )
    assert whole.output_text == text


def test_text_format_json_schema_gives_matching_json(stack: RunningStack) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}},
        "required": ["name"],
        "additionalProperties": False,
    }
    response = client(stack).responses.create(
        model=model_name(stack),
        input="Name a fruit as JSON.",
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "fruit", "schema": schema, "strict": True}},
    )
    answer = json.loads(response.output_text)
    assert set(answer) == {"name"}


def test_a_tool_round_trip(stack: RunningStack) -> None:
    model = model_name(stack)
    first = client(stack).responses.create(
        model=model,
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    assert call.call_id
    second = client(stack).responses.create(
        model=model,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=20,
        temperature=0,
    )
    assert second.output[0].type == "message"
    assert second.output_text


def test_a_streamed_call_has_argument_events(stack: RunningStack) -> None:
    events = list(
        client(stack).responses.create(
            model=model_name(stack),
            input="What is the weather in Paris?",
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required",
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    # Per call (the model may make more than one): its argument pieces join into its done text.
    dones = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert dones
    for done in dones:
        pieces = "".join(
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.item_id == done.item_id
        )
        assert pieces == done.arguments
        assert set(json.loads(done.arguments)) == {"city"}
    assert events[-1].type == "response.completed"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_call_cut_by_max_output_tokens_is_incomplete(stack: RunningStack, stream: bool) -> None:
    """A forced call the limit cuts is no call to run: the item and the response end
    `incomplete`, whole or streamed."""
    request: dict[str, Any] = {
        "model": model_name(stack),
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 4,
        "temperature": 0,
    }
    if stream:
        events = list(client(stack).responses.create(**request, stream=True))
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [item.status for item in done if item.type == "function_call"] == ["incomplete"]
    else:
        response = client(stack).responses.create(**request)
    assert response.status == "incomplete"
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].status == "incomplete"
    with pytest.raises(json.JSONDecodeError):
        json.loads(calls[0].arguments)


def test_previous_response_id_continues_and_retrieve_and_delete(stack: RunningStack) -> None:
    api = client(stack)
    model = model_name(stack)
    first = api.responses.create(
        model=model, input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    second = api.responses.create(
        model=model,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # The earlier turn is in the prompt: more input tokens than the question alone.
    alone = api.responses.create(
        model=model, input="What is my name?", max_output_tokens=8, temperature=0, store=False
    )
    assert second.usage is not None and alone.usage is not None
    assert second.usage.input_tokens > alone.usage.input_tokens
    retrieved = api.responses.retrieve(second.id)
    assert retrieved.id == second.id
    assert retrieved.output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(alone.id)  # store: false
    api.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(second.id)


def test_stored_responses_are_scoped_per_tenant(stack: RunningStack) -> None:
    response = client(stack, TENANT_A_KEY).responses.create(
        model=model_name(stack), input="Hello", max_output_tokens=4, temperature=0
    )
    assert client(stack, TENANT_A_KEY).responses.retrieve(response.id).id == response.id
    with pytest.raises(openai.NotFoundError):
        client(stack, TENANT_B_KEY).responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client(stack, TENANT_B_KEY).responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client(stack, TENANT_B_KEY).responses.create(
            model=model_name(stack), input="Hi", previous_response_id=response.id
        )
    assert client(stack, TENANT_A_KEY).responses.retrieve(response.id).id == response.id


def post(stack: RunningStack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{stack.http}/responses",
        json=body,
        headers={"Authorization": f"Bearer {TENANT_A_KEY}"},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("temprature", 0.5), ("max_output_tokens", "many"), ("input", 3), ("tool_choice", "maybe")],
)
def test_a_bad_field_is_a_400_naming_it(stack: RunningStack, field: str, value: Any) -> None:
    body = {"model": model_name(stack), "input": "Hi", field: value}
    answer = post(stack, body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(field)


def test_an_unknown_previous_response_id_is_a_404(stack: RunningStack) -> None:
    answer = post(
        stack, {"model": model_name(stack), "input": "Hi", "previous_response_id": "resp_nope"}
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["param"] == "previous_response_id"


# llm-comply's tests that need what the served model does not have: a skip, with the reason.
NOT_APPLICABLE = {"image-input": "the served model takes text only (no image input)"}


def test_llm_comply_open_responses_group_passes(stack: RunningStack) -> None:
    """llm-comply's Open Responses group (it validates each answer and stream event against the
    spec's OpenAPI schema) against this stack: every applicable test passes; its own
    capability gate may skip the test that needs another vendor's reasoning models."""
    assert_group_passes(
        stack,
        "open-responses",
        basic_test="basic-response",
        not_applicable=NOT_APPLICABLE,
        gated={"reasoning-summary": None},
        api_key=TENANT_A_KEY,
    )
