"""A reader slower than the engine gets fewer messages carrying the same tokens: through the
public API (the tokenizer tier merges what piles up) and on the scheduler's own Submit stream
(the scheduler merges), on the real stack with the embedded model, greedy."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import TypeVar

import grpc
import pytest

from protos.llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc, text_pb2, text_pb2_grpc
from services.common.sampling_proto import sampling_to_proto
from services.contracts.sampling_params import SamplingParams
from services.stack import RunningStack

pytestmark = pytest.mark.slow

# A reader whose HTTP/2 window holds a few small messages: while it does not read, the
# sender's writes wait, and what the engine produces meanwhile piles up (back-pressure).
SLOW_READER_OPTIONS = [("grpc.http2.lookahead_bytes", 64), ("grpc.http2.bdp_probe", 0)]
PROMPT = "Once upon a time,"
NUM_TOKENS = 40

Message = TypeVar("Message")


def read_after_generation(call: Iterable[Message], stack: RunningStack) -> list[Message]:
    """Every message of a stream, reading the first, then nothing until the engine has
    generated every token (however slow the machine is), then the rest."""
    iterator = iter(call)
    first = next(iterator)
    stats = stack.wait_all_blocks_free(timeout_s=120)
    assert stats.num_running == 0, "the request did not finish while its reader waited"
    return [first, *iterator]


def ids_of(
    messages: Sequence[text_pb2.GenerateResponse | scheduler_pb2.SubmitResponse],
) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def test_slow_client_gets_fewer_messages_with_the_same_ids_and_text(stack: RunningStack) -> None:
    request = text_pb2.GenerateRequest(
        prompt=PROMPT,
        sampling=text_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=NUM_TOKENS, ignore_eos=True
        ),
    )
    fast = list(stack.text_stub().Generate(request, timeout=120))
    with grpc.insecure_channel(stack.public, options=SLOW_READER_OPTIONS) as channel:
        slow = read_after_generation(
            text_pb2_grpc.TextGenerationStub(channel).Generate(request, timeout=120), stack
        )
    assert len(ids_of(fast)) == NUM_TOKENS
    assert ids_of(slow) == ids_of(fast)
    assert "".join(m.text for m in slow) == "".join(m.text for m in fast)
    assert len(slow) < NUM_TOKENS
    assert slow[-1].finish_reason == fast[-1].finish_reason == "length"
    assert slow[-1].usage.completion_tokens == NUM_TOKENS
    assert stack.wait_all_blocks_free().num_running == 0


def test_scheduler_merges_what_a_slow_reader_let_pile_up(stack: RunningStack) -> None:
    prompt_ids = list(
        stack.text_stub().Tokenize(text_pb2.TokenizeRequest(text=PROMPT), timeout=10).token_ids
    )
    sampling = sampling_to_proto(
        SamplingParams(temperature=0.0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    )

    def submit(channel: grpc.Channel) -> Iterable[scheduler_pb2.SubmitResponse]:
        request = scheduler_pb2.SubmitRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt_ids, sampling=sampling
        )
        return scheduler_pb2_grpc.SchedulerStub(channel).Submit(  # type: ignore[no-any-return]
            request, timeout=120, metadata=stack.internal_metadata
        )

    with grpc.insecure_channel(stack.scheduler) as channel:
        fast = list(submit(channel))
    with grpc.insecure_channel(stack.scheduler, options=SLOW_READER_OPTIONS) as channel:
        slow = read_after_generation(submit(channel), stack)
    assert len(ids_of(fast)) == NUM_TOKENS
    assert ids_of(slow) == ids_of(fast)
    # At most one message per step, and the backlog went out merged.
    assert len(fast) <= NUM_TOKENS
    assert len(slow) < NUM_TOKENS and max(len(m.token_ids) for m in slow) > 1
    assert slow[-1].finish_reason == "length"
    assert slow[0].queue_ms > 0 and all(m.queue_ms == 0 for m in slow[1:])
    assert stack.wait_all_blocks_free().num_running == 0
