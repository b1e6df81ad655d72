"""Greedy output through the real stack (default flags) never depends on the batch: each of 20
prompts sent alone twice (the second time its prompt comes from the prefix cache) and once
among all 20 at the same time gives the same tokens every time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
SUBJECTS = [
    "a lighthouse keeper",
    "the history of tea",
    "how bridges stay up",
    "a cat who learns to fly",
    "the moon's phases",
    "making bread at home",
    "a robot painter",
    "why the sky is blue",
    "a letter to a future self",
    "the rules of chess",
    "a city under the sea",
    "learning a language",
    "the water cycle",
    "a dragon who hates fire",
    "how computers add numbers",
    "a winter market",
    "the first airplane",
    "a garden in the desert",
    "a detective in Paris",
    "the life of a star",
]
PROMPTS = [
    f"Write a few sentences about {subject}. " + "Be clear and friendly. " * (i % 4)
    for i, subject in enumerate(SUBJECTS)
]


def greedy_ids(stack: RunningStack, prompt: str) -> list[int]:
    request = text_pb2.GenerateRequest(
        prompt=prompt,
        sampling=text_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True
        ),
    )
    responses = stack.text_stub().Generate(request, timeout=120)
    return [token for response in responses for token in response.token_ids]


def test_twenty_prompts_repeat_alone_and_in_a_batch(stack: RunningStack) -> None:
    alone = [greedy_ids(stack, prompt) for prompt in PROMPTS]
    assert all(len(ids) == NEW_TOKENS for ids in alone)
    repeated = [greedy_ids(stack, prompt) for prompt in PROMPTS]
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        together = list(pool.map(lambda prompt: greedy_ids(stack, prompt), PROMPTS))
    differing = [i for i in range(len(PROMPTS)) if not alone[i] == repeated[i] == together[i]]
    assert not differing, f"prompts whose greedy tokens changed: {differing}"
    assert stack.wait_all_blocks_free().num_running == 0
