"""The worker's persistent batch turns a plan into forward inputs: which rows are decodes and
which sequences sample."""

from __future__ import annotations

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence
from services.worker.input_batch import InputBatch


def prepared(num_tokens: int, num_computed: int, scheduled: int) -> tuple[list[str], int]:
    """(sampled ids, prefill tokens) of one sequence's step."""
    batch = InputBatch(16, "cpu")
    token_ids = list(range(100, 100 + num_tokens))
    plan = BatchPlan(
        step_id=0,
        new_sequences=[
            NewSequence("r", token_ids, num_tokens, [0, 1, 2], num_computed, SamplingParams())
        ],
        num_scheduled_tokens={"r": scheduled},
    )
    batch.apply(plan)
    inputs = batch.prepare(plan)
    return inputs.sampled_request_ids, inputs.forward.num_prefill_tokens


def test_a_one_token_chunk_short_of_the_end_is_a_prefill_that_does_not_sample() -> None:
    # 16 tokens from the prefix cache, one token of budget left: position 16 of 31.
    assert prepared(31, 16, 1) == ([], 1)


def test_the_last_token_alone_is_a_decode_that_samples() -> None:
    assert prepared(31, 30, 1) == (["r"], 0)


def test_a_chunk_reaching_the_end_samples() -> None:
    assert prepared(31, 16, 15) == (["r"], 15)
    assert prepared(31, 0, 31) == (["r"], 31)
    assert prepared(31, 0, 16) == ([], 16)
