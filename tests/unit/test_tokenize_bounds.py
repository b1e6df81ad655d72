"""Tokenize, Detokenize (gRPC) and the Anthropic door's count_tokens bounded as Generate is:
text no context could hold is refused naming the field before the tokenizer sees it (a real
tokenizer tier, scripted scheduler); Detokenize takes no more ids than a context holds, each
in the vocabulary."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest

from protos.llmserve.v1 import text_pb2
from services.tokenizer.server import ServedModel
from tests.unit.tokenizer_tier_harness import (
    MAX_MODEL_LEN,
    Stack,
    rpc_error,
    run,
    running_stack,
    served_model,
)


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return served_model()


class CountingTokenizer:
    """The served tokenizer, counting how often a text reaches it."""

    def __init__(self, stack: Stack) -> None:
        self.calls = 0
        tokenizer = stack.server.generator.model.tokenizer
        for name in ("encode", "apply_chat_template"):
            original = getattr(tokenizer, name)

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.calls += 1
                return _original(*args, **kwargs)

            setattr(tokenizer, name, counted)


def test_tokenize_refuses_text_no_context_holds_untokenized(model: ServedModel) -> None:
    too_long = "a" * (model.max_prompt_chars + 1)

    async def scenario() -> None:
        async with running_stack(model) as stack:
            counting = CountingTokenizer(stack)
            for request, field in (
                (text_pb2.TokenizeRequest(text=too_long), "text"),
                (
                    text_pb2.TokenizeRequest(
                        messages=[text_pb2.ChatMessage(role="user", content=too_long)]
                    ),
                    "messages",
                ),
            ):
                error = await rpc_error(stack.stub.Tokenize(request))
                assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert field in (error.details() or ""), error.details()
            assert counting.calls == 0
            # Longer than the context but not beyond any context: counted, as a client asks.
            long = await stack.stub.Tokenize(text_pb2.TokenizeRequest(text="hello " * 200))
            assert len(long.token_ids) > MAX_MODEL_LEN

    run(scenario)


def test_detokenize_takes_a_context_of_known_ids(model: ServedModel) -> None:
    async def scenario() -> None:
        async with running_stack(model) as stack:
            for ids in ([1] * (MAX_MODEL_LEN + 1), [model.vocab_size], [5, -1], [2**31 - 1]):
                request = text_pb2.DetokenizeRequest(token_ids=ids)
                error = await rpc_error(stack.stub.Detokenize(request))
                assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, ids
                assert "token_ids" in (error.details() or ""), error.details()
            ok = await stack.stub.Detokenize(text_pb2.DetokenizeRequest(token_ids=[1] * 8))
            assert isinstance(ok.text, str)

    run(scenario)


def test_count_tokens_refuses_text_no_context_holds(model: ServedModel) -> None:
    too_long = "a" * (model.max_prompt_chars + 1)
    big_schema = {"type": "object", "description": too_long}

    async def scenario() -> None:
        async with running_stack(model, http_max_body_bytes=64 * 1024 * 1024) as stack:
            assert stack.server.http is not None
            counting = CountingTokenizer(stack)
            url = f"http://127.0.0.1:{stack.server.http.port}/v1/messages/count_tokens"
            hello = [{"role": "user", "content": "hi"}]
            async with httpx.AsyncClient(timeout=10) as client:
                for body, field in (
                    ({"messages": [{"role": "user", "content": too_long}]}, "messages"),
                    ({"messages": hello, "system": too_long}, "messages"),
                    (
                        {
                            "messages": hello,
                            "tools": [{"name": "f", "input_schema": big_schema}],
                        },
                        "tools",
                    ),
                ):
                    answer = await client.post(url, json={"model": model.name, **body})
                    assert answer.status_code == 400, answer.text
                    error = answer.json()["error"]
                    assert error["message"].startswith(field), error
                assert counting.calls == 0
                ok = await client.post(url, json={"model": model.name, "messages": hello})
                assert ok.status_code == 200 and ok.json()["input_tokens"] > 0

    run(scenario)
