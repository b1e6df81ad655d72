"""--reasoning-parser through the tokenizer tier's two doors, on the embedded model's real
tokenizer and a scripted scheduler: a chat answer's `<think>` text goes out apart from its
content (gRPC `reasoning_text`, HTTP `reasoning_content`), a plain prompt's does not."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from protos.llmserve.v1 import text_pb2
from services.tokenizer.server import ServedModel
from tests.unit.tokenizer_tier_harness import (
    FakeEngine,
    run,
    running_stack,
    script_for,
    served_model,
)

OUTPUT = "<think>\nThe user greets me.\n</think>\n\nHello there!"
CHAT = [text_pb2.ChatMessage(role="user", content="Hi")]


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return served_model()


def test_grpc_chat_answers_carry_the_reasoning_apart(model: ServedModel) -> None:
    engine = FakeEngine(script_for(model.tokenizer.encode(OUTPUT), chunk=2))

    async def scenario() -> None:
        async with running_stack(model, [engine], reasoning_parser="qwen3") as stack:
            chat = await stack.generate(text_pb2.GenerateRequest(messages=CHAT))
            plain = await stack.generate(text_pb2.GenerateRequest(prompt="Hi"))
        assert "".join(r.reasoning_text for r in chat).strip() == "The user greets me."
        assert "".join(r.text for r in chat) == "Hello there!"
        assert sum(len(r.token_ids) for r in chat) == len(model.tokenizer.encode(OUTPUT))
        # A completion is text, whatever it holds.
        assert "".join(r.text for r in plain) == OUTPUT
        assert not any(r.reasoning_text for r in plain)

    run(scenario)


@pytest.mark.parametrize("stream", [False, True])
def test_http_chat_answers_carry_reasoning_content(model: ServedModel, stream: bool) -> None:
    engine = FakeEngine(script_for(model.tokenizer.encode(OUTPUT), chunk=3))

    async def scenario() -> None:
        async with running_stack(model, [engine], reasoning_parser="qwen3") as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1/chat/completions"
            body = {
                "model": model.name,
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": stream,
            }
            response = await asyncio.to_thread(httpx.post, url, json=body, timeout=10)
        assert response.status_code == 200, response.text
        if stream:
            chunks = [
                line.removeprefix("data: ")
                for line in response.text.splitlines()
                if line.startswith("data: {")
            ]
            deltas = [json.loads(c)["choices"][0]["delta"] for c in chunks]
            reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
            content = "".join(d.get("content", "") for d in deltas)
        else:
            message = response.json()["choices"][0]["message"]
            reasoning, content = message["reasoning_content"], message["content"]
        assert reasoning.strip() == "The user greets me."
        assert content == "Hello there!"

    run(scenario)


def test_an_unknown_reasoning_parser_is_refused_naming_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from services.common.config_flags import add_config_flags
    from services.tokenizer.config import TokenizerConfig

    parser = argparse.ArgumentParser(prog="llmserve tokenizer")
    add_config_flags(parser, TokenizerConfig)
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "r2"])
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "deepseek_r1" in err and "qwen3" in err
