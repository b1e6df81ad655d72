"""Engine protos ↔ dataclasses (the only place besides the servers that touches protos)."""

from __future__ import annotations

from protos.llmserve.v1 import engine_pb2
from services.common.sampling_params import SamplingParams
from services.scheduler.plan import TokenEvent
from services.scheduler.scheduler import SchedulerStats


def sampling_from_proto(message: engine_pb2.EngineSamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        seed=message.seed if message.HasField("seed") else None,
        max_new_tokens=message.max_new_tokens,
        min_new_tokens=message.min_new_tokens,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs,
    )


def sampling_to_proto(params: SamplingParams) -> engine_pb2.EngineSamplingParams:
    message = engine_pb2.EngineSamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        max_new_tokens=params.max_new_tokens,
        min_new_tokens=params.min_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
    )
    if params.seed is not None:
        message.seed = params.seed
    return message


def event_to_proto(event: TokenEvent) -> engine_pb2.SubmitResponse:
    return engine_pb2.SubmitResponse(
        token_ids=event.new_token_ids,
        finish_reason=event.finish_reason.value if event.finish_reason is not None else "",
        logprobs=[
            engine_pb2.EngineTokenLogprob(
                token_id=token_id,
                logprob=lp.token_logprob,
                top_token_ids=lp.top_token_ids,
                top_logprobs=lp.top_logprobs,
            )
            for token_id, lp in zip(event.new_token_ids, event.logprobs, strict=False)
        ],
        num_prompt_tokens=event.num_prompt_tokens,
        num_cached_tokens=event.num_cached_tokens,
    )


def stats_to_proto(
    stats: SchedulerStats, scheduler_id: str, max_waiting: int
) -> engine_pb2.EngineStats:
    return engine_pb2.EngineStats(
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        prefix_hit_rate=stats.prefix_hit_rate,
        num_preemptions=stats.num_preemptions,
        scheduler_id=scheduler_id,
        max_waiting_requests=max_waiting,
    )
