"""Answers of a real stack's OpenAI door held against the official `openai` package's models
in strict mode, plus the fields OpenAI's published schema marks required (the package's models
default nullable required fields to None, so presence is checked by key); forced tool calls
streamed in pieces and cut by max_tokens; llm-comply's OpenAI Chat group."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion

from services.stack import RunningStack
from tests.e2e.llm_comply import assert_group_passes

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three fruits."}]
# Required keys in OpenAI's OpenAPI spec (CreateChatCompletionResponse and its parts).
CHAT_REQUIRED = {"id", "choices", "created", "model", "object"}
CHAT_CHOICE_REQUIRED = {"finish_reason", "index", "message", "logprobs"}
CHAT_MESSAGE_REQUIRED = {"content", "refusal", "role"}
USAGE_REQUIRED = {"prompt_tokens", "completion_tokens", "total_tokens"}


def model_name(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])


def test_a_chat_completion_is_valid_against_the_official_models(stack: RunningStack) -> None:
    body = {"model": model_name(stack), "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    answer = httpx.post(f"{stack.http}/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    raw = answer.json()
    ChatCompletion.model_validate(raw, strict=True)
    assert raw.keys() >= CHAT_REQUIRED
    assert raw["usage"].keys() >= USAGE_REQUIRED
    for choice in raw["choices"]:
        assert choice.keys() >= CHAT_CHOICE_REQUIRED
        assert choice["message"].keys() >= CHAT_MESSAGE_REQUIRED
        assert choice["message"]["refusal"] is None


def test_a_completion_is_valid_against_the_official_models(stack: RunningStack) -> None:
    body = {"model": model_name(stack), "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    answer = httpx.post(f"{stack.http}/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    raw = answer.json()
    Completion.model_validate(raw, strict=True)
    assert {"id", "choices", "created", "model", "object"} <= raw.keys()
    for choice in raw["choices"]:
        assert {"finish_reason", "index", "logprobs", "text"} <= choice.keys()


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_stream_options_without_stream_is_a_400_naming_it(stack: RunningStack, path: str) -> None:
    body: dict[str, object] = {"model": model_name(stack), "max_tokens": 2}
    body.update({"messages": MESSAGES} if path.startswith("/chat") else {"prompt": "Hi"})
    body["stream_options"] = {"include_usage": True}
    answer = httpx.post(f"{stack.http}{path}", json=body, timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "stream_options"


def test_every_bad_logit_bias_key_is_named(stack: RunningStack) -> None:
    body = {
        "model": model_name(stack),
        "messages": MESSAGES,
        "max_tokens": 2,
        "logit_bias": {"x": 1, "5": 1, "y": 2},
    }
    answer = httpx.post(f"{stack.http}/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "'x'" in message and "'y'" in message


def test_a_model_is_retrieved_by_id_and_an_unknown_id_is_a_404(stack: RunningStack) -> None:
    api = openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=30)
    name = model_name(stack)
    model = api.models.retrieve(name)
    assert model.id == name and model.object == "model"
    listed = httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]
    assert isinstance(listed["max_model_len"], int) and listed["max_model_len"] > 0
    assert (model.model_extra or {}).get("max_model_len") == listed["max_model_len"]
    with pytest.raises(openai.NotFoundError) as caught:
        api.models.retrieve("no-such-model")
    error = caught.value.response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "no-such-model" in error["message"]


def test_return_token_ids_and_logprobs_zero_on_a_real_stack(stack: RunningStack) -> None:
    body = {
        "model": model_name(stack),
        "prompt": "Hello",
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    raw = httpx.post(f"{stack.http}/completions", json=body, timeout=120).json()
    (choice,) = raw["choices"]
    assert choice["prompt_token_ids"] and all(
        isinstance(t, int) for t in choice["prompt_token_ids"]
    )
    # logprobs: 0 lists the sampled token alone, with its own logprob.
    logprobs = choice["logprobs"]
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert top == {token: logprob}


def test_chat_stream_chunks_are_valid_against_the_official_models(stack: RunningStack) -> None:
    body = {
        "model": model_name(stack),
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = []
    with httpx.stream("POST", f"{stack.http}/chat/completions", json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk, strict=True)
        assert {"id", "choices", "created", "model", "object"} <= chunk.keys()
        for choice in chunk["choices"]:
            assert {"delta", "finish_reason", "index"} <= choice.keys()
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"].keys() >= USAGE_REQUIRED


# ---- forced tool calls cut by max_tokens --------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
FORCED_CHOICES: dict[str, object] = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def forced_body(stack: RunningStack, choice: str, max_tokens: int) -> dict[str, object]:
    return {
        "model": model_name(stack),
        "messages": WEATHER_QUESTION,
        "tools": [WEATHER],
        "tool_choice": FORCED_CHOICES[choice],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def streamed_calls(
    stack: RunningStack, body: dict[str, object]
) -> tuple[dict[int, list[str]], str]:
    """Per call index, its argument pieces in order; and the finish reason."""
    pieces: dict[int, list[str]] = {}
    finish = ""
    with httpx.stream(
        "POST", f"{stack.http}/chat/completions", json={**body, "stream": True}, timeout=300
    ) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                assert not choice["delta"].get("content")  # a forced answer has no content
                for call in choice["delta"].get("tool_calls") or []:
                    pieces.setdefault(call["index"], []).append(call["function"]["arguments"])
                finish = choice["finish_reason"] or finish
    return pieces, finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_streams_its_arguments_in_pieces(stack: RunningStack, choice: str) -> None:
    body = forced_body(stack, choice, 80)
    pieces, finish = streamed_calls(stack, body)
    assert finish == "tool_calls"
    (arguments,) = pieces.values()
    assert len([p for p in arguments if p]) > 1  # as tokens arrive, not whole at the end
    assert isinstance(json.loads("".join(arguments))["city"], str)


# Limits that land before a call's name closes, right after it, and inside its arguments (the
# embedded model's required list is some 18 tokens, a named call's arguments some 8).
CUTS = [("required", 3), ("required", 10), ("required", 14), ("named", 1), ("named", 3)]


@pytest.mark.parametrize(("choice", "max_tokens"), CUTS)
def test_a_forced_call_cut_by_max_tokens_is_a_length_finish_without_a_broken_call(
    stack: RunningStack, choice: str, max_tokens: int
) -> None:
    """Never a call that cannot be made in a whole answer, never the forced JSON as content; a
    stream has sent the pieces it had and says "length"."""
    body = forced_body(stack, choice, max_tokens)
    answer = httpx.post(f"{stack.http}/chat/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    ChatCompletion.model_validate(answer.json(), strict=True)
    (whole,) = answer.json()["choices"]
    assert whole["finish_reason"] == "length"
    assert not whole["message"]["content"]
    for call in whole["message"].get("tool_calls") or []:
        json.loads(call["function"]["arguments"])  # only whole calls
    _, finish = streamed_calls(stack, body)
    assert finish == "length"


# ---- llm-comply's OpenAI Chat group ---------------------------------------------------------

# Its tests that need what the served model does not have: not run, with the reason.
CHAT_NOT_APPLICABLE = {"chat-image-input": "the served model takes text only (no image input)"}
# Its own capability gate skips these, with its reason.
CHAT_GATED = {"chat-reasoning-summary": "o-series"}


def test_llm_comply_openai_chat_group_passes(short_context_stack: RunningStack) -> None:
    """llm-comply's OpenAI Chat group (it validates each answer and stream chunk against
    OpenAI's published schema) against this stack: every applicable test passes; the one
    that needs another vendor's reasoning models is skipped by its own gate."""
    assert_group_passes(
        short_context_stack,
        "openai-chat",
        basic_test="chat-basic-response",
        not_applicable=CHAT_NOT_APPLICABLE,
        gated=CHAT_GATED,
    )
