"""--reasoning-parser through the tokenizer tier's two doors, on the embedded model's real
tokenizer and a scripted scheduler: a chat answer's `<think>` text goes out apart from its
content (gRPC `reasoning_text`, HTTP `reasoning_content`), a plain prompt's does not."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from protos.llmserve.v1 import sampling_pb2, text_pb2
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


@pytest.mark.parametrize("thinking_off", [False, True])
def test_a_grammar_waits_for_the_end_of_thinking(
    model: ServedModel, thinking_off: bool, tmp_path: Path
) -> None:
    """Under a reasoning parser a chat request's grammar starts after `</think>`, unless the
    template already closed the thinking in the prompt (Qwen3 with thinking off)."""
    engine = FakeEngine(script_for(model.tokenizer.encode('{"a": 1}'), finish_reason="stop"))
    config: dict[str, object] = {"reasoning_parser": "qwen3"}
    if thinking_off:
        template = tmp_path / "no_thinking.jinja"
        template.write_text(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
        config["chat_template"] = str(template)

    async def scenario() -> None:
        async with running_stack(model, [engine], **config) as stack:
            request = text_pb2.GenerateRequest(
                messages=CHAT,
                sampling=text_pb2.SamplingParams(
                    structured_output=sampling_pb2.StructuredOutput(json_object=True)
                ),
            )
            await stack.generate(request)
            await stack.generate(text_pb2.GenerateRequest(prompt="Hi", sampling=request.sampling))
        chat, plain = (r.sampling.structured_output for r in engine.requests)
        end = model.tokenizer.encode("</think>", add_special_tokens=False)
        assert list(chat.starts_after) == ([] if thinking_off else end)
        assert chat.json_object
        assert list(plain.starts_after) == []  # a completion has no thinking to wait for

    run(scenario)
