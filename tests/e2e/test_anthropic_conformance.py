"""The Anthropic door of a real stack held against the published Messages API: every answer
and stream event valid against the official `anthropic` package's models (strict) and against
Anthropic's OpenAPI schema as llm-comply ships it (which also says which nullable keys are
required); the behaviours Anthropic's API has (thinking on a model that shows none, an
assistant prefill, its error shape on unknown routes); and llm-comply's Anthropic group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import llm_comply.specs
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from llm_comply.schema import SpecLoader
from pydantic import TypeAdapter

from services.stack import RunningStack
from tests.e2e.llm_comply import assert_group_passes

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three fruits."}]
SYSTEM = "Be brief."
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the weather of a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
# Stream events → their schema in Anthropic's OpenAPI document.
EVENT_SCHEMAS = {
    "message_start": "MessageStartEvent",
    "content_block_start": "ContentBlockStartEvent",
    "content_block_delta": "ContentBlockDeltaEvent",
    "content_block_stop": "ContentBlockStopEvent",
    "message_delta": "MessageDeltaEvent",
    "message_stop": "MessageStopEvent",
}
STREAM_EVENT = TypeAdapter[RawMessageStreamEvent](RawMessageStreamEvent)


def anthropic_spec() -> SpecLoader:
    """Anthropic's OpenAPI document, as llm-comply ships it."""
    return SpecLoader(str(Path(llm_comply.specs.__file__).parent / "anthropic.json"))


@pytest.fixture(scope="module")
def spec() -> SpecLoader:
    return anthropic_spec()


def model_name(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])


def post(stack: RunningStack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.http}/messages", json=body, timeout=300)


def streamed_events(stack: RunningStack, body: dict[str, Any]) -> list[tuple[str, Any]]:
    events = []
    with httpx.stream(
        "POST", f"{stack.http}/messages", json={**body, "stream": True}, timeout=300
    ) as answer:
        assert answer.status_code == 200
        name = ""
        for line in answer.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def assert_valid_message(raw: dict[str, Any], spec: SpecLoader) -> None:
    Message.model_validate(raw, strict=True)
    assert spec.validate(raw, "Message") == []


def test_a_message_and_its_stream_are_valid_against_the_published_schema(
    stack: RunningStack, spec: SpecLoader
) -> None:
    body = {
        "model": model_name(stack),
        "max_tokens": 12,
        "messages": MESSAGES,
        "system": SYSTEM,
        "temperature": 0,
    }
    answer = post(stack, body)
    assert answer.status_code == 200, answer.text
    assert_valid_message(answer.json(), spec)
    count_body = {key: body[key] for key in ("model", "messages", "system")}
    counted = httpx.post(f"{stack.http}/messages/count_tokens", json=count_body, timeout=60)
    MessageTokensCount.model_validate(counted.json(), strict=True)
    assert spec.validate(counted.json(), "CountMessageTokensResponse") == []
    events = streamed_events(stack, body)
    assert [name for name, _ in events][-1] == "message_stop"
    for name, data in events:
        assert data["type"] == name
        STREAM_EVENT.validate_python(data, strict=True)
        assert spec.validate(data, EVENT_SCHEMAS[name]) == [], (name, data)


def test_a_tool_use_answer_and_its_stream_are_valid(stack: RunningStack, spec: SpecLoader) -> None:
    body = {
        "model": model_name(stack),
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "any"},
        "temperature": 0,
    }
    answer = post(stack, body)
    assert answer.status_code == 200, answer.text
    raw = answer.json()
    assert_valid_message(raw, spec)
    assert any(block["type"] == "tool_use" for block in raw["content"])
    for name, data in streamed_events(stack, body):
        STREAM_EVENT.validate_python(data, strict=True)
        assert spec.validate(data, EVENT_SCHEMAS[name]) == [], (name, data)


def test_an_error_is_valid_against_the_published_schema(
    stack: RunningStack, spec: SpecLoader
) -> None:
    answer = post(stack, {"model": model_name(stack), "messages": MESSAGES})
    assert answer.status_code == 400
    raw = answer.json()
    ErrorResponse.model_validate(raw, strict=True)
    assert spec.validate(raw, "ErrorResponse") == []
    assert raw["request_id"] == answer.headers["request-id"]
    assert raw["error"]["message"].startswith("max_tokens")
    # count_tokens' errors carry an id too (none was sent: one of ours).
    counted = httpx.post(f"{stack.http}/messages/count_tokens", json={"messages": MESSAGES})
    assert counted.status_code == 400
    assert spec.validate(counted.json(), "ErrorResponse") == []
    assert counted.json()["request_id"] == counted.headers["request-id"]


def test_thinking_on_a_server_without_a_reasoning_parser_answers_in_text(
    stack: RunningStack, spec: SpecLoader
) -> None:
    body = {
        "model": model_name(stack),
        "max_tokens": 8,
        "messages": MESSAGES,
        "temperature": 0,
    }
    thinking = {"type": "enabled", "budget_tokens": 1024, "display": "summarized"}
    answer = post(stack, {**body, "thinking": thinking})
    assert answer.status_code == 200, answer.text
    raw = answer.json()
    assert_valid_message(raw, spec)
    assert [block["type"] for block in raw["content"]] == ["text"]
    # The same answer as without thinking: nothing was added to the prompt.
    assert raw["content"] == post(stack, body).json()["content"]


def test_an_assistant_prefill_is_continued(stack: RunningStack) -> None:
    """The answer goes on from the prefill's last character, as a completion of the chat
    template's text cut there does (greedy: the same tokens)."""
    api = anthropic.Anthropic(
        base_url=stack.http.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300
    )
    model = model_name(stack)
    prefill = "The three fruits are"
    conversation = [*MESSAGES, {"role": "assistant", "content": prefill}]
    message = api.messages.create(
        model=model,
        max_tokens=8,
        system=SYSTEM,
        messages=conversation,  # type: ignore[arg-type]
        extra_body={"temperature": 0},
    )
    [block] = message.content
    assert block.type == "text" and block.text
    assert not block.text.startswith(prefill)  # the continuation alone, as Anthropic's API
    # SmolLM2's ChatML template, cut after the prefill (no end of turn, no new turn).
    prompt = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
        f"{MESSAGES[0]['content']}<|im_end|>\n<|im_start|>assistant\n{prefill}"
    )
    completion = httpx.post(
        f"{stack.http}/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=300,
    ).json()
    assert block.text == completion["choices"][0]["text"]
    prompt_tokens = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert prompt_tokens == completion["usage"]["prompt_tokens"]
    counted = api.messages.count_tokens(
        model=model,
        system=SYSTEM,
        messages=conversation,  # type: ignore[arg-type]
    )
    assert counted.input_tokens == prompt_tokens
    # Streamed, the same continuation.
    events = list(
        api.messages.create(
            model=model,
            max_tokens=8,
            system=SYSTEM,
            messages=conversation,  # type: ignore[arg-type]
            stream=True,
            extra_body={"temperature": 0},
        )
    )
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert text == block.text


@pytest.mark.parametrize(
    ("method", "path", "status", "error_type"),
    [
        ("GET", "/messages", 405, "invalid_request_error"),
        ("GET", "/messages/count_tokens", 405, "invalid_request_error"),
        ("POST", "/messages/batches", 404, "not_found_error"),
    ],
)
def test_unknown_routes_and_methods_answer_in_anthropic_shape(
    stack: RunningStack, spec: SpecLoader, method: str, path: str, status: int, error_type: str
) -> None:
    answer = httpx.request(method, f"{stack.http}{path}", json={}, timeout=30)
    assert answer.status_code == status
    raw = answer.json()
    assert raw["type"] == "error" and raw["error"]["type"] == error_type
    assert spec.validate(raw, "ErrorResponse") == []
    if status == 405:
        assert "POST" in answer.headers["allow"]
    # Beside the door, the OpenAI door's shape stays.
    other = httpx.get(f"{stack.http}/nothing-here", timeout=30)
    assert other.status_code == 404 and "type" not in other.json()


# llm-comply's tests that need what the served model does not have: a skip, with the reason.
NOT_APPLICABLE = {"anth-image-input": "the served model takes text only (no image input)"}
# Skipped by llm-comply's own capability gate: it runs only against Anthropic's models.
GATED: dict[str, str | None] = {"anth-thinking-display": None}


def test_llm_comply_anthropic_group_passes(short_context_stack: RunningStack) -> None:
    """llm-comply's Anthropic group (each answer validated against Anthropic's OpenAPI schema,
    then its behaviour checked) against this stack: every applicable test passes."""
    assert_group_passes(
        short_context_stack,
        "anthropic",
        basic_test="anth-basic-response",
        not_applicable=NOT_APPLICABLE,
        gated=GATED,
    )
