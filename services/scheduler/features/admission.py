"""Admission's pure rules: which requests this scheduler can ever serve, how many it holds at
most, and how soon a seat frees for one refused at that bound (what its retry hint is made
from)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from services.contracts.errors import CapacityError, InvalidRequestError, QueueFullError
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request


def check_servable(request: Request, config: SchedulerConfig, kv: KVCacheManager) -> None:
    """Raise InvalidRequestError (the field at fault) or CapacityError for a request that could
    never run here, however empty the scheduler were."""
    n = request.sampling.n
    if n > min(config.max_num_seqs, config.max_num_batched_tokens):
        raise InvalidRequestError(
            "n",
            f"{n} choices run at once; this scheduler runs at most {config.max_num_seqs} "
            f"sequences and {config.max_num_batched_tokens} tokens per step",
        )
    if not request.prompt_token_ids:
        raise InvalidRequestError("prompt_token_ids", "must not be empty")
    if request.num_prompt_tokens + 1 > config.max_model_len:
        raise CapacityError(
            f"prompt of {request.num_prompt_tokens} tokens leaves no room for output "
            f"(max_model_len={config.max_model_len})"
        )
    if not kv.can_ever_fit(request):
        raise CapacityError(
            f"prompt of {request.num_prompt_tokens} tokens needs more KV blocks than exist "
            f"({kv.num_total_blocks})"
        )


def max_num_unfinished_requests(config: SchedulerConfig) -> int:
    """The admission bound: every seat taken and max_waiting_requests waiting behind them.

    Free seats count as queue room: a burst queues whole in `waiting` until the next step
    admits it, and a bound on `waiting` alone would refuse part of a burst smaller than
    seats + queue while the seats stand empty. Equivalently: refuse when waiting would
    exceed max_waiting_requests + (max_num_seqs - running). Admission and preemption move
    requests between the two lists and leave the count as it is: only a finish makes
    room. A free seat counts even when the KV blocks for it are not free: its request
    waits for blocks as any queued one does, and the bound still holds the queue to
    max_waiting_requests + max_num_seqs.
    """
    return config.max_num_seqs + config.max_waiting_requests


def queue_full(num_waiting: int, num_running: int, config: SchedulerConfig) -> QueueFullError:
    """The refusal of a request at the bound (the step loop adds the retry hint)."""
    return QueueFullError(
        f"{num_waiting} requests waiting and {num_running} running "
        f"(at most {config.max_waiting_requests} waiting beyond {config.max_num_seqs} seats)"
    )


def steps_until_a_seat_frees(
    running: list[Request], waiting: Iterable[Request], config: SchedulerConfig
) -> int:
    """At most how many steps until a request holding a seat finishes, which is what makes
    room at the admission bound (a stop token may end one sooner): the fewest any running
    request has left to its length limit. With no seat taken yet, the fewest among the
    requests the next steps admit."""
    holders = running or list(itertools.islice(waiting, config.max_num_seqs))
    if not holders:
        return 1
    return max(1, min(_steps_to_length_limit(r, config.max_model_len) for r in holders))


def _steps_to_length_limit(request: Request, max_model_len: int) -> int:
    """One step per output token still to come before max_new_tokens or max_model_len, plus
    one for a prompt not computed yet (a long one in chunks takes more)."""
    num_left = min(
        request.sampling.max_new_tokens - request.num_output_tokens_with_pending,
        max_model_len - request.num_tokens_with_pending,
    )
    num_prefill_steps = 1 if request.num_computed_tokens < request.num_prompt_tokens else 0
    return num_prefill_steps + max(num_left, 0)
