"""The worker's side of worker.proto: plans in, its description and results out (the only
place the worker touches protos; the scheduler's side is services/scheduler/worker_convert.py)."""

from __future__ import annotations

from protos.llmserve.v1 import logprobs_pb2, worker_pb2
from services.common.kv_destination_proto import kv_destination_from_proto, kv_export_from_proto
from services.common.model_description_proto import description_to_proto
from services.common.sampling_proto import sampling_from_proto
from services.contracts.memory_budget import MemoryBudget
from services.contracts.step import (
    BatchPlan,
    DiskStore,
    NewSequence,
    SequenceDelta,
    StepResult,
)
from services.contracts.worker_description import WorkerDescription


def worker_description_to_proto(description: WorkerDescription) -> worker_pb2.WorkerDescription:
    return worker_pb2.WorkerDescription(
        model=description_to_proto(description.model),
        architecture=description.architecture,
        dtype=description.dtype,
        device=description.device,
        block_size=description.block_size,
        num_kv_blocks=description.num_kv_blocks,
        kv_cache_dtype=description.kv_cache_dtype,
        quantization=description.quantization,
        worker_epoch=description.worker_epoch,
        sliding_window=description.sliding_window,
        max_loras=description.max_loras,
        max_lora_rank=description.max_lora_rank,
        batch_invariant=description.batch_invariant,
        kv_disk_block_hashes=description.kv_disk_block_hashes,
        kv_disk_tier=description.kv_disk_tier,
        host_identity=description.host_identity,
        memory=memory_budget_to_proto(description.memory),
    )


def memory_budget_to_proto(budget: MemoryBudget) -> worker_pb2.MemoryBudget:
    return worker_pb2.MemoryBudget(
        weight_bytes_by_kind=budget.weight_bytes_by_kind,
        weight_mapped_bytes=budget.weight_mapped_bytes,
        kv_cache_bytes=budget.kv_cache_bytes,
        kv_cache_blocks=budget.kv_cache_blocks,
        kv_cache_tokens=budget.kv_cache_tokens,
        runtime_bytes=budget.runtime_bytes,
        machine_bytes=budget.machine_bytes,
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
                lora_name=seq.lora_name,
                cache_salt=seq.cache_salt,
                kv_destination=kv_destination_from_proto(seq.kv_destination),
            )
            for seq in message.new_sequences
        ],
        block_deltas=[
            SequenceDelta(d.request_id, list(d.new_block_ids)) for d in message.block_deltas
        ],
        num_scheduled_tokens=dict(
            zip(message.scheduled_request_ids, message.num_scheduled_tokens, strict=True)
        ),
        finished_request_ids=list(message.finished_request_ids),
        block_copies=[(c.src, c.dst) for c in message.block_copies],
        draft_slots=dict(message.draft_slots),
        block_truncations=dict(message.block_truncations),
        disk_stores=[
            DiskStore(d.block_id, d.block_hash, d.lora_name, d.cache_salt)
            for d in message.disk_stores
        ],
        disk_loads={
            request_id: [(b.block_id, b.block_hash) for b in loads.blocks]
            for request_id, loads in message.disk_loads.items()
        },
        kv_exports=[kv_export_from_proto(export) for export in message.kv_exports],
    )


def result_to_proto(result: StepResult, forward_ms: float) -> worker_pb2.StepOutput:
    message = worker_pb2.StepOutput(
        step_id=result.step_id,
        sampled_request_ids=list(result.sampled_token_ids),
        sampled_token_ids=list(result.sampled_token_ids.values()),
        forward_ms=forward_ms,
    )
    for request_id, logprobs in result.logprobs.items():
        # Logprobs come only with a sampled token: the message names it, as on every hop.
        message.logprobs[request_id].CopyFrom(
            logprobs_pb2.TokenLogprob(
                token_id=result.sampled_token_ids[request_id],
                logprob=logprobs.token_logprob,
                top_token_ids=logprobs.top_token_ids,
                top_logprobs=logprobs.top_logprobs,
            )
        )
    for request_id, num_proposed in result.num_proposed_drafts.items():
        outcome = message.drafts[request_id]
        outcome.num_proposed = num_proposed
        outcome.accepted_token_ids.extend(result.accepted_draft_ids.get(request_id, ()))
        outcome.proposer = result.draft_proposers.get(request_id, "")
    message.failed_sequences.update(result.failed_sequences)
    message.disk_added.extend(result.disk_added)
    message.disk_evicted.extend(result.disk_evicted)
    return message
