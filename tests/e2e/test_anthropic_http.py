"""The Anthropic Messages API door of a real stack (`llmserve up`, two tokenizer replicas
sharing the HTTP port, the embedded model in float32), driven by the official `anthropic`
client: a whole message and the same one streamed (greedy, so the same text)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from services.stack import RunningStack

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three fruits."}]


def model_name(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])


def test_a_message_whole_and_streamed_with_the_anthropic_client(stack: RunningStack) -> None:
    api = anthropic.Anthropic(
        base_url=stack.http.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=120
    )
    model = model_name(stack)
    greedy = {"temperature": 0}  # the client has no sampling arguments: sent as extra body fields
    whole = api.messages.create(
        model=model, max_tokens=12, messages=MESSAGES, system="Be brief.", extra_body=greedy
    )
    assert whole.id.startswith("msg_") and whole.role == "assistant"
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert 0 < whole.usage.output_tokens <= 12
    counted = api.messages.count_tokens(model=model, messages=MESSAGES, system="Be brief.")
    assert counted.input_tokens == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens or 0
    )

    events = list(
        api.messages.create(
            model=model,
            max_tokens=12,
            messages=MESSAGES,
            system="Be brief.",
            stream=True,
            extra_body=greedy,
        )
    )
    types = [event.type for event in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert text == block.text  # greedy: the same answer either way
    last = events[-2]
    assert last.type == "message_delta"
    assert last.delta.stop_reason == whole.stop_reason
    assert last.usage.output_tokens == whole.usage.output_tokens
