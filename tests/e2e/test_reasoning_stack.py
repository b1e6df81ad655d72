"""Reasoning output on a real stack (`llmserve up --reasoning-parser deepseek_r1`, the embedded
model under a chat template that opens the thinking in the prompt, as DeepSeek R1's does),
driven by the official `openai` client: what the model writes before `</think>` comes back as
`reasoning_content`, apart from the content, streaming and not; a grammar waits for the
answer, so the thinking stays free text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack

pytestmark = pytest.mark.slow

# The embedded model never writes `</think>` on its own: everything it writes is thinking.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def reasoning_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    template = Path(tmp_path_factory.mktemp("templates")) / "thinking.jinja"
    template.write_text(TEMPLATE)
    # Exact fp32 (`gguf-exact`): a prompt served from the prefix cache then gives the same
    # greedy answer as the first time (the gguf default's fp16 KV cache rounds the cached
    # keys, and the embedded model's first tokens are near ties).
    flags = [
        "--reasoning-parser", "deepseek_r1", "--chat-template", str(template),
        "--quantization", "gguf-exact",
    ]  # fmt: skip
    with e2e_stack(flags) as running:
        yield running
    assert running.returncode == 0


def client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=300)


def model_name(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])


def test_the_thinking_comes_apart_streaming_and_not(reasoning_stack: RunningStack) -> None:
    api, model = client(reasoning_stack), model_name(reasoning_stack)
    whole = api.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    message = whole.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert reasoning and not message.content
    assert whole.usage is not None and whole.usage.completion_tokens == 16  # max_tokens counts it
    streamed_reasoning, streamed_content = "", ""
    for chunk in api.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=16,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    ):
        delta = chunk.choices[0].delta
        streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, "")
    # A completion is text, thinking or not.
    completion = api.completions.create(model=model, prompt="Why", max_tokens=4, temperature=0)
    assert completion.choices[0].text


def test_a_grammar_waits_for_the_answer(reasoning_stack: RunningStack) -> None:
    """Under a JSON grammar the thinking is still free text: the grammar has not started."""
    api, model = client(reasoning_stack), model_name(reasoning_stack)
    answer = api.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
    )
    message = answer.choices[0].message
    free = (
        api.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=16,
            temperature=0,  # type: ignore[arg-type]
        )
        .choices[0]
        .message
    )
    assert (message.model_extra or {}).get("reasoning_content") == (
        (free.model_extra or {}).get("reasoning_content")
    )
    assert not (message.model_extra or {})["reasoning_content"].lstrip().startswith("{")


def test_open_responses_reasoning_is_its_own_item(reasoning_stack: RunningStack) -> None:
    """/v1/responses: the thinking is a `reasoning` item (streamed as response.reasoning.*
    events), the same text as chat's reasoning_content."""
    api, model = client(reasoning_stack), model_name(reasoning_stack)
    chat = api.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    whole = api.responses.create(
        model=model, input=QUESTION[0]["content"], max_output_tokens=16, temperature=0
    )
    assert whole.output[0].type == "reasoning"
    thinking = "".join(part.text for part in whole.output[0].content or ())
    assert thinking == chat.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    events = list(
        api.responses.create(
            model=model,
            input=QUESTION[0]["content"],
            max_output_tokens=16,
            temperature=0,
            stream=True,
        )
    )
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning.delta")
    done = next(e for e in events if e.type == "response.reasoning.done")
    assert streamed == done.text == thinking


def test_anthropic_thinking_blocks_are_valid_against_the_published_schema(
    reasoning_stack: RunningStack,
) -> None:
    """At the Anthropic door the thinking is a thinking block (all of it here: the model never
    closes it), valid against the `anthropic` package's models and Anthropic's OpenAPI schema,
    whole and streamed; `display: omitted` leaves it out."""
    from tests.e2e.test_anthropic_conformance import (
        EVENT_SCHEMAS,
        STREAM_EVENT,
        anthropic_spec,
        assert_valid_message,
        streamed_events,
    )

    spec = anthropic_spec()
    thinking = {"type": "enabled", "budget_tokens": 1024}
    body = {
        "model": model_name(reasoning_stack),
        "max_tokens": 8,
        "messages": QUESTION,
        "temperature": 0,
        "thinking": thinking,
    }
    answer = httpx.post(f"{reasoning_stack.http}/messages", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    raw = answer.json()
    assert_valid_message(raw, spec)
    [block] = raw["content"]
    assert block["type"] == "thinking" and block["thinking"]
    events = streamed_events(reasoning_stack, body)
    for name, data in events:
        STREAM_EVENT.validate_python(data, strict=True)
        assert spec.validate(data, EVENT_SCHEMAS[name]) == [], (name, data)
    streamed = "".join(
        data["delta"]["thinking"]
        for name, data in events
        if name == "content_block_delta" and data["delta"]["type"] == "thinking_delta"
    )
    assert streamed == block["thinking"]
    omitted = {**body, "thinking": {**thinking, "display": "omitted"}}
    hidden = httpx.post(f"{reasoning_stack.http}/messages", json=omitted, timeout=300).json()
    assert all(block["type"] != "thinking" for block in hidden["content"])
