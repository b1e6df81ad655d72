"""Speculative decoding through a real stack (tokenizer → scheduler → worker on the embedded
model), asked for per request by both doors: greedy tokens are the same with and without it,
the scheduler counts drafts proposed and accepted, a bad limit is refused naming the field, and
every KV block ends up free. Speculation is on by default and its decisions are in the
scheduler's /metrics; a --no-speculation stack drafts nothing."""

from __future__ import annotations

from typing import Any

import grpc
import openai
import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack
from tests.e2e.test_metrics import Sample, scrape_until, total

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


def test_speculation_is_on_by_default_and_its_decisions_are_in_the_metrics(
    stack: RunningStack,
) -> None:
    """A request that says nothing drafts (both proposers on by default), and the scheduler's
    /metrics tells the drafts granted, proposed and accepted by proposer, and each decode
    step's outcome."""
    plain = grpc_ids(stack, num_speculative_tokens=0)
    before = stack.stats()
    for _ in range(3):  # the cost line is learnt from the first steps
        assert grpc_ids(stack) == plain
    after = stack.stats()
    assert after.num_draft_tokens_accepted > before.num_draft_tokens_accepted

    def counted(samples: list[Sample]) -> bool:
        return total(samples, "llmserve_spec_decode_accepted_tokens_total") > 0

    _, samples = scrape_until(stack.info["metrics"], counted)
    granted = total(samples, "llmserve_spec_decode_granted_tokens_total")
    proposed = total(samples, "llmserve_spec_decode_draft_tokens_total")
    accepted = total(samples, "llmserve_spec_decode_accepted_tokens_total")
    assert granted >= proposed >= accepted > 0
    by_proposer = {
        proposer: total(samples, "llmserve_spec_decode_draft_tokens_total", proposer=proposer)
        for proposer in ("ngram", "suffix")
    }
    assert sum(by_proposer.values()) == proposed
    assert total(samples, "llmserve_spec_decode_steps_total", outcome="drafted") > 0
    # num_speculative_tokens=0 above: steps where no decode may draft.
    assert total(samples, "llmserve_spec_decode_steps_total", outcome="ineligible") > 0
    assert total(samples, "llmserve_spec_decode_steps_total", outcome="off") == 0


def test_no_speculation_turns_every_proposer_off(stack: RunningStack) -> None:
    """The baseline stack: --no-speculation overrides the speculative flags given with it and
    a request's own num_speculative_tokens; greedy output is the same, nothing is drafted,
    and every decode step says `off`."""
    flags = ["--no-speculation", "--speculative-ngram", "5", "--tokenizer-replicas", "1"]
    with e2e_stack(flags) as baseline:
        ids = grpc_ids(baseline, num_speculative_tokens=5)
        stats = baseline.stats()
        assert stats.num_draft_tokens_proposed == stats.num_draft_tokens_accepted == 0
        num_decodes = len(ids) - 1  # the first token came with the prefill

        def counted(samples: list[Sample]) -> bool:
            off = total(samples, "llmserve_spec_decode_steps_total", outcome="off")
            return off >= num_decodes

        _, samples = scrape_until(baseline.info["metrics"], counted)
        assert counted(samples)
        assert total(samples, "llmserve_spec_decode_steps_total", outcome="drafted") == 0
        assert total(samples, "llmserve_spec_decode_granted_tokens_total") == 0
    assert baseline.returncode == 0
    assert ids == grpc_ids(stack)  # the default stack, drafting
