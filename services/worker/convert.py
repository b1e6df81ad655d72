"""Worker protos ↔ the plan/result dataclasses (the only place the worker touches protos)."""

from __future__ import annotations

from protos.llmserve.v1 import worker_pb2
from services.common.sampling_proto import sampling_from_proto, sampling_to_proto
from services.scheduler.plan import (
    BatchPlan,
    NewSequence,
    SequenceDelta,
    StepResult,
    TokenLogprobs,
)


def plan_to_proto(plan: BatchPlan) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        step_id=plan.step_id,
        finished_ids=plan.finished_ids,
        new_sequences=[
            worker_pb2.NewSequence(
                request_id=seq.request_id,
                token_ids=seq.token_ids,
                num_prompt_tokens=seq.num_prompt_tokens,
                block_ids=seq.block_ids,
                num_computed_tokens=seq.num_computed_tokens,
                sampling=sampling_to_proto(seq.sampling),
            )
            for seq in plan.new_sequences
        ],
        block_deltas=[
            worker_pb2.SequenceDelta(request_id=d.request_id, new_block_ids=d.new_block_ids)
            for d in plan.block_deltas
        ],
        scheduled_ids=list(plan.num_scheduled_tokens),
        num_scheduled_tokens=list(plan.num_scheduled_tokens.values()),
        block_copies=[worker_pb2.BlockCopy(src=s, dst=d) for s, d in plan.block_copies],
    )


def plan_from_proto(message: worker_pb2.StepPlan) -> BatchPlan:
    return BatchPlan(
        step_id=message.step_id,
        new_sequences=[
            NewSequence(
                request_id=seq.request_id,
                token_ids=list(seq.token_ids),
                num_prompt_tokens=seq.num_prompt_tokens,
                block_ids=list(seq.block_ids),
                num_computed_tokens=seq.num_computed_tokens,
                sampling=sampling_from_proto(seq.sampling),
            )
            for seq in message.new_sequences
        ],
        block_deltas=[
            SequenceDelta(d.request_id, list(d.new_block_ids)) for d in message.block_deltas
        ],
        num_scheduled_tokens=dict(
            zip(message.scheduled_ids, message.num_scheduled_tokens, strict=True)
        ),
        finished_ids=list(message.finished_ids),
        block_copies=[(c.src, c.dst) for c in message.block_copies],
    )


def result_to_proto(result: StepResult, forward_ms: float) -> worker_pb2.StepOutput:
    message = worker_pb2.StepOutput(
        step_id=result.step_id,
        sampled_ids=list(result.sampled_token_ids),
        sampled_token_ids=list(result.sampled_token_ids.values()),
        forward_ms=forward_ms,
    )
    for request_id, logprobs in result.logprobs.items():
        message.logprobs[request_id].CopyFrom(
            worker_pb2.TokenLogprobs(
                token_logprob=logprobs.token_logprob,
                top_token_ids=logprobs.top_token_ids,
                top_logprobs=logprobs.top_logprobs,
            )
        )
    return message


def result_from_proto(message: worker_pb2.StepOutput) -> StepResult:
    return StepResult(
        step_id=message.step_id,
        sampled_token_ids=dict(zip(message.sampled_ids, message.sampled_token_ids, strict=True)),
        logprobs={
            request_id: TokenLogprobs(
                lp.token_logprob, list(lp.top_token_ids), list(lp.top_logprobs)
            )
            for request_id, lp in message.logprobs.items()
        },
    )
