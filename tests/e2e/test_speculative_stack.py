"""Speculative decoding through a real stack (tokenizer → scheduler → worker on the embedded
model), asked for per request by both doors: greedy tokens are the same with and without it,
the scheduler counts drafts proposed and accepted, a bad limit is refused naming the field, and
every KV block ends up free."""

from __future__ import annotations

from typing import Any

import grpc
import openai
import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack

pytestmark = pytest.mark.slow

MESSAGES = [
    {
        "role": "user",
        "content": "Repeat exactly: the mill by the river was rebuilt three times in a hundred "
        "years, and the mill by the river still grinds rye and barley for the bakery.",
    }
]
NUM_TOKENS = 48


def grpc_ids(stack: RunningStack, **sampling: Any) -> list[int]:
    request = text_pb2.GenerateRequest(
        messages=[text_pb2.ChatMessage(**m) for m in MESSAGES],
        sampling=text_pb2.SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, **sampling),
    )
    return [t for r in stack.text_stub().Generate(request, timeout=120) for t in r.token_ids]


def test_greedy_tokens_are_the_same_with_drafts_by_grpc_and_http(stack: RunningStack) -> None:
    plain = grpc_ids(stack, num_speculative_tokens=0)
    before = stack.stats()
    # The first requests teach the scheduler the step cost; drafts come once it knows it.
    for _ in range(3):
        assert grpc_ids(stack, num_speculative_tokens=5) == plain
    after = stack.stats()
    accepted = after.num_draft_tokens_accepted - before.num_draft_tokens_accepted
    proposed = after.num_draft_tokens_proposed - before.num_draft_tokens_proposed
    assert 0 < accepted <= proposed
    api = openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=120)
    [model] = stack.text_stub().ListModels(text_pb2.ListModelsRequest(), timeout=10).models
    response: Any = api.chat.completions.create(
        model=model.name,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=NUM_TOKENS,
        temperature=0,
        extra_body={"num_speculative_tokens": 5, "return_token_ids": True},
    )
    assert list(response.choices[0].model_extra["token_ids"]) == plain
    stats = stack.wait_all_blocks_free()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_limit_out_of_range_is_refused_naming_the_field(stack: RunningStack) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        grpc_ids(stack, num_speculative_tokens=99)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.num_speculative_tokens" in (caught.value.details() or "")
    api = openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=60)
    [model] = stack.text_stub().ListModels(text_pb2.ListModelsRequest(), timeout=10).models
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(
            model=model.name, prompt="hi", max_tokens=4, extra_body={"num_speculative_tokens": -1}
        )
    assert "num_speculative_tokens" in str(refused.value)
