"""Protobuf <-> plain data for the tier's calls to schedulers (scheduler.proto, and lora.proto
as a scheduler answers it). The routing wing's calls (pool.py, submit_stream.py, adapters.py)
and the servicer's pins are the only users; the public text.proto half is ../convert.py."""

from __future__ import annotations

from collections.abc import Sequence

from protos.llmserve.v1 import lora_pb2, scheduler_pb2
from services.common.named_prompt import NamedPrompt, pin_name
from services.common.prefix_hash import tenant_salt
from services.common.sampling_proto import sampling_to_proto
from services.tokenizer.output import SchedulerOutput, TokenLogprob
from services.tokenizer.routing.adapter_info import AdapterInfo
from services.tokenizer.routing.prefix_fetch import PrefixSource
from services.tokenizer.routing.scheduler_snapshot import SchedulerSnapshot
from services.tokenizer.validation import ValidatedRequest


def submit_request(
    request: ValidatedRequest,
    arrival_unix_s: float,
    prefill_scheduler: str = "",
    prefix_source: PrefixSource | None = None,
) -> scheduler_pb2.SubmitRequest:
    """`prefill_scheduler`: the prefill pair for its prompt (docs/disaggregation.md);
    `prefix_source`: another scheduler holding more of its prefix (prefix_fetch.py)."""
    return scheduler_pb2.SubmitRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling=sampling_to_proto(request.sampling),
        arrival_unix_s=arrival_unix_s,
        cache_salt=request.cache_salt,
        tenant_id=request.tenant_id,
        tenant_weight=request.tenant_weight,
        lora_name=request.lora_name,
        prefill_scheduler=prefill_scheduler,
        prefix_source=prefix_source.address if prefix_source else "",
        prefix_source_blocks=prefix_source.num_blocks if prefix_source else 0,
    )


def pin_request(prompt: NamedPrompt) -> scheduler_pb2.PinRequest:
    """A named prompt's KV to pin on a scheduler, under its tenant's name and salt."""
    return scheduler_pb2.PinRequest(
        name=pin_name(prompt.tenant_id, prompt.name),
        token_ids=list(prompt.token_ids),
        cache_salt=tenant_salt(prompt.tenant_id),
        ttl_s=float(prompt.ttl_s),
    )


def unpin_request(tenant_id: str, name: str) -> scheduler_pb2.UnpinRequest:
    return scheduler_pb2.UnpinRequest(name=pin_name(tenant_id, name))


def cancel_choice_request(request_id: str, index: int) -> scheduler_pb2.CancelChoiceRequest:
    return scheduler_pb2.CancelChoiceRequest(request_id=request_id, index=index)


def scheduler_output(response: scheduler_pb2.SubmitResponse) -> SchedulerOutput:
    return SchedulerOutput(
        token_ids=tuple(response.token_ids),
        logprobs=tuple(
            TokenLogprob(
                token_id=item.token_id,
                logprob=item.logprob,
                top_token_ids=tuple(item.top_token_ids),
                top_logprobs=tuple(item.top_logprobs),
            )
            for item in response.logprobs
        ),
        finish_reason=response.finish_reason,
        queue_ms=response.queue_ms,
        num_cached_tokens=response.num_cached_tokens,
        num_prompt_tokens=response.num_prompt_tokens,
        index=response.index,
    )


def merged_scheduler_output(responses: Sequence[scheduler_pb2.SubmitResponse]) -> SchedulerOutput:
    """Consecutive messages of one choice of a Submit stream as one SchedulerOutput: ids and
    logprobs in order, the last finish reason, and of each counter the last value reported
    (the value `output.Progress` would keep, reading them one at a time).

    That is protobuf's own merge for proto3 messages (repeated fields append, a scalar set
    to a non-default value overwrites), done in C: k responses cost about one conversion.
    """
    if len(responses) == 1:
        return scheduler_output(responses[0])
    merged = scheduler_pb2.SubmitResponse()
    for response in responses:
        merged.MergeFrom(response)
    return scheduler_output(merged)


def scheduler_outputs_by_choice(
    responses: Sequence[scheduler_pb2.SubmitResponse],
) -> list[SchedulerOutput]:
    """Messages of a Submit stream as one SchedulerOutput per choice (n > 1 interleaves them),
    in the order the choices first appear."""
    by_index: dict[int, list[scheduler_pb2.SubmitResponse]] = {}
    for response in responses:
        by_index.setdefault(response.index, []).append(response)
    return [merged_scheduler_output(group) for group in by_index.values()]


def scheduler_snapshot(stats: scheduler_pb2.SchedulerStats) -> SchedulerSnapshot:
    return SchedulerSnapshot(
        scheduler_id=stats.scheduler_id,
        worker_epoch=stats.worker_epoch,
        block_size=stats.block_size,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_free_blocks=stats.num_free_blocks,
        dtype=stats.dtype,
        kv_cache_dtype=stats.kv_cache_dtype,
        quantization=stats.quantization,
        lora_adapters=frozenset(stats.lora_adapters),
        active_lora_adapters=frozenset(stats.active_lora_adapters),
        max_loras=stats.max_loras,
        role=stats.role or "both",
    )


def adapter_info(info: lora_pb2.LoraAdapterInfo) -> AdapterInfo:
    """One scheduler's answer about one of its adapters."""
    return AdapterInfo(
        name=info.name,
        path=info.path,
        rank=info.rank,
        targets=tuple(info.targets),
        scaling=info.scaling,
        load_ms=info.load_ms,
        num_running=info.num_running,
    )
