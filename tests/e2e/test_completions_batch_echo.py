"""/v1/completions on a real stack with a batch of prompts (strings, token-id lists) and with
echo, driven by the official `openai` client: choices prompt-major (index = prompt * n + j),
usage summed over the prompts, a stream whose chunks name their choice by that index, each
prompt echoed with null logprobs for its tokens, and a clear 400 naming the prompt at fault."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import httpx
import openai
import pytest
from openai.types.completion import Completion

from services.stack import RunningStack

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):"]
MAX_TOKENS = 4
# ignore_eos: every choice is exactly MAX_TOKENS long, so the usage is known in advance.
FIXED_LENGTH = {"ignore_eos": True, "return_token_ids": True}


def api(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=300)


def model_name(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])


def prompt_ids(stack: RunningStack, prompt: str) -> list[int]:
    """The prompt's token ids as the stack tokenizes it (a single-prompt request)."""
    one = api(stack).completions.create(
        model=model_name(stack), prompt=prompt, max_tokens=1, extra_body=FIXED_LENGTH
    )
    return list((one.choices[0].model_extra or {})["prompt_token_ids"])


def test_a_batch_of_texts_is_answered_prompt_major_with_summed_usage(stack: RunningStack) -> None:
    n = 2
    answer = api(stack).completions.create(
        model=model_name(stack),
        prompt=PROMPTS,
        n=n,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=FIXED_LENGTH,
    )
    Completion.model_validate(answer.model_dump(), strict=True)
    assert [choice.index for choice in answer.choices] == list(range(len(PROMPTS) * n))
    ids = [prompt_ids(stack, prompt) for prompt in PROMPTS]
    for choice in answer.choices:
        extra = choice.model_extra or {}
        assert extra["prompt_token_ids"] == ids[choice.index // n]
        assert choice.finish_reason == "length"
    # Greedy: a prompt's two choices agree.
    texts = [choice.text for choice in answer.choices]
    assert texts[0::2] == texts[1::2]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == sum(len(i) for i in ids)
    assert answer.usage.completion_tokens == len(PROMPTS) * n * MAX_TOKENS


def test_a_batch_of_token_id_lists_is_served(stack: RunningStack) -> None:
    ids = [prompt_ids(stack, prompt) for prompt in PROMPTS[:2]]
    answer = api(stack).completions.create(
        model=model_name(stack), prompt=ids, max_tokens=MAX_TOKENS, extra_body=FIXED_LENGTH
    )
    assert [(c.model_extra or {})["prompt_token_ids"] for c in answer.choices] == ids
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == sum(len(i) for i in ids)
    assert answer.usage.completion_tokens == 2 * MAX_TOKENS


def test_a_streamed_batch_names_each_choice_by_its_index(stack: RunningStack) -> None:
    n = 2
    body: dict[str, Any] = {
        "model": model_name(stack),
        "prompt": PROMPTS[:2],
        "n": n,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        **FIXED_LENGTH,
    }
    tokens: dict[int, list[int]] = defaultdict(list)
    finishes: dict[int, str] = {}
    prompt_of: dict[int, list[int]] = {}
    chunks = []
    with httpx.stream("POST", f"{stack.http}/completions", json=body, timeout=300) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        tokens[choice["index"]] += choice["token_ids"]
        if "prompt_token_ids" in choice:
            prompt_of[choice["index"]] = choice["prompt_token_ids"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    ids = [prompt_ids(stack, prompt) for prompt in PROMPTS[:2]]
    assert finishes == {index: "length" for index in range(2 * n)}
    assert {index: len(t) for index, t in tokens.items()} == {i: MAX_TOKENS for i in range(2 * n)}
    assert prompt_of == {index: ids[index // n] for index in range(2 * n)}
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens"] == sum(len(i) for i in ids)
    assert usage["completion_tokens"] == 2 * n * MAX_TOKENS


def test_echo_prepends_the_prompt_with_null_logprobs_for_its_tokens(stack: RunningStack) -> None:
    prompt = PROMPTS[1]
    ids = prompt_ids(stack, prompt)
    for sent in (prompt, ids):
        answer = api(stack).completions.create(
            model=model_name(stack),
            prompt=sent,
            echo=True,
            logprobs=1,
            max_tokens=MAX_TOKENS,
            # Greedy: a sampled token may be a special one (ignore_eos runs past <|im_end|>),
            # which the logprobs name but the text leaves out, as vLLM's do.
            temperature=0,
            extra_body=FIXED_LENGTH,
        )
        (choice,) = answer.choices
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        assert choice.logprobs is not None
        token_logprobs = choice.logprobs.token_logprobs or []
        assert token_logprobs[: len(ids)] == [None] * len(ids)
        assert all(isinstance(lp, float) for lp in token_logprobs[len(ids) :])
        assert len(token_logprobs) == len(ids) + MAX_TOKENS
        assert "".join(choice.logprobs.tokens or []) == choice.text


def test_a_streamed_echo_starts_each_choice_with_its_prompt(stack: RunningStack) -> None:
    stream = api(stack).completions.create(
        model=model_name(stack),
        prompt=PROMPTS[:2],
        echo=True,
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body=FIXED_LENGTH,
    )
    texts: dict[int, str] = defaultdict(str)
    firsts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.text)
            texts[choice.index] += choice.text
    assert sorted(firsts) == [0, 1]
    for index, prompt in enumerate(PROMPTS[:2]):
        assert firsts[index].startswith(prompt)
        assert texts[index].startswith(prompt) and texts[index].count(prompt) >= 1


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        (["x"] * 33, "prompt"),
        (["fine", ""], "prompt[1]"),
        ([[1, 2], [10**9]], "prompt[1]"),
    ],
)
def test_a_bad_batch_is_a_400_naming_the_prompt(
    stack: RunningStack, prompt: object, param: str
) -> None:
    body = {"model": model_name(stack), "prompt": prompt, "max_tokens": 2}
    answer = httpx.post(f"{stack.http}/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
