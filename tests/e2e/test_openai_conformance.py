"""Answers of a real stack's OpenAI door held against the official `openai` package's models
in strict mode, plus the fields OpenAI's published schema marks required (the package's models
default nullable required fields to None, so presence is checked by key)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion

from services.stack import RunningStack

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
