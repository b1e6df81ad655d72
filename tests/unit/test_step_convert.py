"""The step plan and result, and the worker's description, survive worker.proto: each side's
converter out, the other's in."""

from __future__ import annotations

from services.contracts.model_description import ModelDescription
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import (
    BatchPlan,
    DiskStore,
    NewSequence,
    SequenceDelta,
    StepResult,
    TokenLogprobs,
)
from services.contracts.worker_description import WorkerDescription
from services.scheduler.worker_convert import (
    plan_to_proto,
    result_from_proto,
    worker_description_from_proto,
)
from services.worker.convert import plan_from_proto, result_to_proto, worker_description_to_proto


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


def test_draft_outcomes_round_trip_with_their_proposer() -> None:
    result = StepResult(
        step_id=4,
        sampled_token_ids={"a": 10, "b": 11, "c": 12},
        accepted_draft_ids={"a": [7, 8]},
        num_proposed_drafts={"a": 3, "b": 2},
        draft_proposers={"a": "suffix", "b": "ngram"},
    )
    assert result_from_proto(result_to_proto(result, forward_ms=1.0)) == result


def test_worker_description_round_trip() -> None:
    description = WorkerDescription(
        model=ModelDescription(
            model_name="m",
            vocab_size=100,
            max_model_len=256,
            tokenizer_json="{}",
            chat_template=None,
            bos_token_id=1,
            eos_token_ids=(2, 3),
            add_bos_token=True,
            special_tokens=(("bos_token", "<s>"), ("eos_token", "</s>")),
        ),
        architecture="llama",
        dtype="bfloat16",
        device="cpu",
        block_size=16,
        num_kv_blocks=64,
        kv_cache_dtype="float16",
        quantization="q8_0",
        worker_epoch="e1",
        sliding_window=48,
        kv_disk_block_hashes=[b"\x01" * 32, b"\x02" * 32],
        kv_disk_tier=True,
    )
    message = worker_description_to_proto(description)
    assert not message.model.HasField("chat_template")
    assert worker_description_from_proto(message) == description


def test_a_new_sequences_cache_salt_reaches_the_worker() -> None:
    """Suffix decoding scopes drafts by it: the scheduler's request puts it in the sequence,
    the plan's wire form carries it, the worker reads it."""
    from services.scheduler.request import Request

    request = Request("a", [1, 2], SamplingParams(), eos_token_ids=(), cache_salt=b"tenant")
    sequence = request.new_sequence([0])
    assert sequence.cache_salt == b"tenant"
    plan = BatchPlan(step_id=1, new_sequences=[sequence])
    assert plan_from_proto(plan_to_proto(plan)).new_sequences[0].cache_salt == b"tenant"


def test_disk_stores_loads_and_changes_round_trip() -> None:
    plan = BatchPlan(
        step_id=3,
        disk_stores=[DiskStore(5, b"\x01" * 32, "sql", b"tenant")],
        disk_loads={"a": [(2, b"\x02" * 32), (3, b"\x03" * 32)]},
    )
    assert plan_from_proto(plan_to_proto(plan)) == plan
    result = StepResult(step_id=3, disk_added=[b"\x01" * 32], disk_evicted=[b"\x04" * 32])
    assert result_from_proto(result_to_proto(result, forward_ms=1.0)) == result
