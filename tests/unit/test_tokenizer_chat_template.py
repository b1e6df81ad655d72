"""The tokenizer tier serving a model that ships no chat template: chat requests are refused
at both doors (gRPC INVALID_ARGUMENT, HTTP 400 in OpenAI's shape, naming `messages`) while
completions keep working, and --chat-template gives the model one. Real gRPC and HTTP on
loopback, the fake scheduler of tokenizer_tier_harness."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import httpx
import pytest

from protos.llmserve.v1 import text_pb2
from services.text.chat_template import ChatMessage
from services.tokenizer.server import ServedModel
from tests.unit.tokenizer_tier_harness import (
    TIMEOUT_S,
    FakeEngine,
    Stack,
    joined_text,
    rpc_error,
    run,
    running_stack,
    script_for,
    served_model,
)

MESSAGES = [{"role": "user", "content": "Capital of France?"}]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def bare_model() -> ServedModel:
    """The embedded model as if its GGUF file had no tokenizer.chat_template."""
    description = served_model().description
    return ServedModel.from_description(dataclasses.replace(description, chat_template=None))


def chat_request() -> text_pb2.GenerateRequest:
    return text_pb2.GenerateRequest(messages=[text_pb2.ChatMessage(**m) for m in MESSAGES])


async def http_post(stack: Stack, path: str, body: dict[str, object]) -> httpx.Response:
    assert stack.server.http is not None
    url = f"http://127.0.0.1:{stack.server.http.port}{path}"
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        return await http.post(url, json=body)


def test_chat_is_refused_at_both_doors_and_completions_work(bare_model: ServedModel) -> None:
    engine = FakeEngine(script_for(bare_model.tokenizer.encode(" Paris.")))

    async def scenario() -> None:
        async with running_stack(bare_model, [engine]) as stack:
            error = await rpc_error(stack.generate(chat_request()))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details().startswith("messages: this model has no chat template")
            tokenize = text_pb2.TokenizeRequest(messages=chat_request().messages)
            error = await rpc_error(stack.stub.Tokenize(tokenize, timeout=TIMEOUT_S))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            register = text_pb2.RegisterPromptRequest(name="rules", system_prompt="Be brief.")
            error = await rpc_error(stack.stub.RegisterPrompt(register, timeout=TIMEOUT_S))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details().startswith("system_prompt: this model has no chat template")

            chat = await http_post(
                stack, "/v1/chat/completions", {"model": bare_model.name, "messages": MESSAGES}
            )
            assert chat.status_code == 400, chat.text
            assert chat.json()["error"]["param"] == "messages"
            assert chat.json()["error"]["type"] == "invalid_request_error"
            message = chat.json()["error"]["message"]
            assert "no chat template" in message and "completions work" in message
            assert engine.requests == []  # nothing reached the scheduler

            completion = await http_post(
                stack, "/v1/completions", {"model": bare_model.name, "prompt": "The capital"}
            )
            assert completion.status_code == 200, completion.text
            assert completion.json()["choices"][0]["text"] == " Paris."
            responses = await stack.generate(text_pb2.GenerateRequest(prompt="The capital"))
            assert joined_text(responses) == " Paris."

    run(scenario)


def test_chat_template_option_gives_the_model_a_template(
    bare_model: ServedModel, tmp_path: Path
) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    engine = FakeEngine(script_for(bare_model.tokenizer.encode(" Paris.")))

    async def scenario() -> None:
        async with running_stack(bare_model, [engine], chat_template=str(path)) as stack:
            responses = await stack.generate(chat_request())
            assert joined_text(responses) == " Paris."
            chat = await http_post(
                stack, "/v1/chat/completions", {"model": bare_model.name, "messages": MESSAGES}
            )
            assert chat.status_code == 200, chat.text
        expected = bare_model.tokenizer.with_chat_template(TEMPLATE).apply_chat_template(
            [ChatMessage(**m) for m in MESSAGES]
        )
        assert [list(r.prompt_token_ids) for r in engine.requests] == [expected, expected]

    run(scenario)
