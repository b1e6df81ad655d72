"""The step plan and result survive worker.proto: the scheduler's side out, the worker's in."""

from __future__ import annotations

from services.common.sampling_params import SamplingParams
from services.contracts.step import (
    BatchPlan,
    NewSequence,
    SequenceDelta,
    StepResult,
    TokenLogprobs,
)
from services.scheduler.worker_convert import plan_to_proto, result_from_proto
from services.worker.convert import plan_from_proto, result_to_proto


def test_plan_round_trip() -> None:
    plan = BatchPlan(
        step_id=7,
        new_sequences=[
            NewSequence(
                request_id="a",
                token_ids=[1, 2, 3, 4],
                num_prompt_tokens=3,
                block_ids=[5, 6],
                num_computed_tokens=2,
                sampling=SamplingParams(temperature=0.5, top_k=4, seed=11),
            )
        ],
        block_deltas=[SequenceDelta("b", [9])],
        num_scheduled_tokens={"a": 2, "b": 1},
        finished_request_ids=["c"],
        block_copies=[(1, 2)],
    )
    assert plan_from_proto(plan_to_proto(plan)) == plan


def test_result_round_trip() -> None:
    result = StepResult(
        step_id=3,
        sampled_token_ids={"a": 10, "b": 11},
        logprobs={"a": TokenLogprobs(-0.5, [10, 12], [-0.5, -1.25])},
    )
    message = result_to_proto(result, forward_ms=1.5)
    # The shared TokenLogprob names the sampled token on the worker hop too.
    assert message.logprobs["a"].token_id == 10
    assert result_from_proto(message) == result
