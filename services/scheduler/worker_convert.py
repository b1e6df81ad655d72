"""The scheduler's side of worker.proto: the worker's description and results in, plans out
(the worker's side is services/worker/convert.py)."""

from __future__ import annotations

from protos.llmserve.v1 import worker_pb2
from services.common.kv_destination_proto import kv_destination_to_proto, kv_export_to_proto
from services.common.model_description_proto import description_from_proto
from services.common.sampling_proto import sampling_to_proto, structured_output_to_proto
from services.contracts.memory_budget import MemoryBudget
from services.contracts.step import BatchPlan, StepResult, TokenLogprobs
from services.contracts.structured_output import StructuredOutput
from services.contracts.worker_description import WorkerDescription


def worker_description_from_proto(message: worker_pb2.WorkerDescription) -> WorkerDescription:
    return WorkerDescription(
        model=description_from_proto(message.model),
        architecture=message.architecture,
        dtype=message.dtype,
        device=message.device,
        block_size=message.block_size,
        num_kv_blocks=message.num_kv_blocks,
        kv_cache_dtype=message.kv_cache_dtype,
        quantization=message.quantization,
        worker_epoch=message.worker_epoch,
        sliding_window=message.sliding_window,
        max_loras=message.max_loras,
        max_lora_rank=message.max_lora_rank,
        batch_invariant=message.batch_invariant,
        kv_disk_block_hashes=list(message.kv_disk_block_hashes),
        kv_disk_tier=message.kv_disk_tier,
        host_identity=message.host_identity,
        memory=MemoryBudget(
            weight_bytes_by_kind=dict(message.memory.weight_bytes_by_kind),
            weight_mapped_bytes=message.memory.weight_mapped_bytes,
            kv_cache_bytes=message.memory.kv_cache_bytes,
            kv_cache_blocks=message.memory.kv_cache_blocks,
            kv_cache_tokens=message.memory.kv_cache_tokens,
            runtime_bytes=message.memory.runtime_bytes,
            machine_bytes=message.memory.machine_bytes,
        ),
    )


def prepare_grammar_request(spec: StructuredOutput) -> worker_pb2.PrepareGrammarRequest:
    return worker_pb2.PrepareGrammarRequest(structured_output=structured_output_to_proto(spec))


def plan_to_proto(plan: BatchPlan) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        step_id=plan.step_id,
        finished_request_ids=plan.finished_request_ids,
        new_sequences=[
            worker_pb2.NewSequence(
                request_id=seq.request_id,
                token_ids=seq.token_ids,
                num_prompt_tokens=seq.num_prompt_tokens,
                block_ids=seq.block_ids,
                num_computed_tokens=seq.num_computed_tokens,
                sampling=sampling_to_proto(seq.sampling),
                lora_name=seq.lora_name,
                cache_salt=seq.cache_salt,
                kv_destination=kv_destination_to_proto(seq.kv_destination),
            )
            for seq in plan.new_sequences
        ],
        block_deltas=[
            worker_pb2.SequenceDelta(request_id=d.request_id, new_block_ids=d.new_block_ids)
            for d in plan.block_deltas
        ],
        scheduled_request_ids=list(plan.num_scheduled_tokens),
        num_scheduled_tokens=list(plan.num_scheduled_tokens.values()),
        block_copies=[worker_pb2.BlockCopy(src=s, dst=d) for s, d in plan.block_copies],
        draft_slots=plan.draft_slots,
        block_truncations=plan.block_truncations,
        disk_stores=[
            worker_pb2.DiskStore(
                block_id=d.block_id,
                block_hash=d.block_hash,
                lora_name=d.lora_name,
                cache_salt=d.cache_salt,
            )
            for d in plan.disk_stores
        ],
        disk_loads={
            request_id: worker_pb2.DiskLoads(
                blocks=[worker_pb2.DiskBlock(block_id=b, block_hash=h) for b, h in loads]
            )
            for request_id, loads in plan.disk_loads.items()
        },
        kv_exports=[kv_export_to_proto(export) for export in plan.kv_exports],
    )


def result_from_proto(message: worker_pb2.StepOutput) -> StepResult:
    return StepResult(
        step_id=message.step_id,
        sampled_token_ids=dict(
            zip(message.sampled_request_ids, message.sampled_token_ids, strict=True)
        ),
        logprobs={
            request_id: TokenLogprobs(lp.logprob, list(lp.top_token_ids), list(lp.top_logprobs))
            for request_id, lp in message.logprobs.items()
        },
        accepted_draft_ids={
            request_id: list(outcome.accepted_token_ids)
            for request_id, outcome in message.drafts.items()
            if outcome.accepted_token_ids
        },
        num_proposed_drafts={
            request_id: outcome.num_proposed for request_id, outcome in message.drafts.items()
        },
        draft_proposers={
            request_id: outcome.proposer
            for request_id, outcome in message.drafts.items()
            if outcome.proposer
        },
        failed_sequences=dict(message.failed_sequences),
        disk_added=list(message.disk_added),
        disk_evicted=list(message.disk_evicted),
    )
