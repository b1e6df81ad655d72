"""Scheduler protos ↔ dataclasses (the only place besides the servers that touches protos)."""

from __future__ import annotations

from protos.llmserve.v1 import logprobs_pb2, scheduler_pb2
from services.contracts.step import TokenEvent
from services.scheduler.stats import SchedulerStats


def event_to_proto(event: TokenEvent) -> scheduler_pb2.SubmitResponse:
    return scheduler_pb2.SubmitResponse(
        token_ids=event.new_token_ids,
        finish_reason=event.finish_reason.value if event.finish_reason is not None else "",
        logprobs=[
            logprobs_pb2.TokenLogprob(
                token_id=token_id,
                logprob=lp.token_logprob,
                top_token_ids=lp.top_token_ids,
                top_logprobs=lp.top_logprobs,
            )
            for token_id, lp in zip(event.new_token_ids, event.logprobs, strict=False)
        ],
        num_prompt_tokens=event.num_prompt_tokens,
        num_cached_tokens=event.num_cached_tokens,
        index=event.index,
    )


def stats_to_proto(
    stats: SchedulerStats,
    scheduler_id: str,
    max_waiting: int,
    *,
    block_size: int,
    worker_epoch: str,
    max_num_seqs: int,
    dtype: str = "",
    kv_cache_dtype: str = "",
    quantization: str = "",
    lora_adapters: list[str] | None = None,
    max_loras: int = 0,
    role: str = "both",
) -> scheduler_pb2.SchedulerStats:
    return scheduler_pb2.SchedulerStats(
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        prefix_hit_rate=stats.prefix_hit_rate,
        num_preemptions=stats.num_preemptions,
        scheduler_id=scheduler_id,
        max_waiting_requests=max_waiting,
        block_size=block_size,
        worker_epoch=worker_epoch,
        max_num_seqs=max_num_seqs,
        num_pinned_blocks=stats.num_pinned_blocks,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        num_forked_block_refs=stats.num_forked_block_refs,
        num_block_copies=stats.num_block_copies,
        num_draft_tokens_proposed=stats.num_draft_tokens_proposed,
        num_draft_tokens_accepted=stats.num_draft_tokens_accepted,
        num_speculative_steps=stats.num_speculative_steps,
        lora_adapters=lora_adapters or [],
        active_lora_adapters=sorted(stats.active_lora_adapters),
        max_loras=max_loras,
        role=role,
    )
