"""Iteration-level scheduler: `schedule(now) -> BatchPlan`, then `update(...) -> events`, per step.

No prefill phase: every request has num_computed_tokens and num_tokens, and a step gives each
scheduled request a slice of the token budget (a decode takes 1, a prompt takes a chunk).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass

from services.common.errors import CapacityError, InvalidRequestError, QueueFullError
from services.contracts.step import (
    BatchPlan,
    FinishReason,
    NewSequence,
    SequenceDelta,
    StepResult,
    TokenEvent,
    TokenLogprobs,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus

_COMPLETED = (FinishReason.STOP, FinishReason.LENGTH)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_pinned_blocks: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_queried_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queried_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int) -> None:
        self.config = config
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            allocation_policy=config.allocation_policy,
            max_model_len=config.max_model_len,
            watermark=config.watermark,
            max_pinned_fraction=config.max_pinned_fraction,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # Sorted by priority (arrival, then submission order), so the preemption victim, the
        # latest arrival, is always last and never already scheduled in the current step.
        self.running: list[Request] = []
        self._priority: dict[str, tuple[float, int]] = {}
        self._num_submitted = 0
        self._on_worker: set[str] = set()  # membership only, never iterated
        self._finished_ids: list[str] = []  # the worker must drop these in the next plan
        self._pending_events: list[TokenEvent] = []  # aborts/expiries, out with the next update
        self._step_id = 0
        self.num_preemptions = 0

    # ---- the engine's calls -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises QueueFullError (back off) or CapacityError (never fits)."""
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already queued")
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        if request.num_prompt_tokens + 1 > self.config.max_model_len:
            raise CapacityError(
                f"prompt of {request.num_prompt_tokens} tokens leaves no room for output "
                f"(max_model_len={self.config.max_model_len})"
            )
        if not self.kv.can_ever_fit(request):
            raise CapacityError(
                f"prompt of {request.num_prompt_tokens} tokens needs more KV blocks than exist "
                f"({self.kv.num_total_blocks})"
            )
        if self.num_unfinished_requests >= self.max_num_unfinished_requests:
            raise QueueFullError(
                f"{len(self.waiting)} requests waiting and {len(self.running)} running "
                f"(at most {self.config.max_waiting_requests} waiting beyond "
                f"{self.config.max_num_seqs} seats)"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._priority[request.request_id] = (request.arrival_time, self._num_submitted)
        self._num_submitted += 1
        self.waiting.append(request)

    @property
    def num_unfinished_requests(self) -> int:
        """Requests held: waiting (never admitted, or preempted) or running."""
        return len(self.waiting) + len(self.running)

    @property
    def max_num_unfinished_requests(self) -> int:
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
        return self.config.max_num_seqs + self.config.max_waiting_requests

    def num_steps_until_a_seat_frees(self) -> int:
        """At most how many steps until a request holding a seat finishes, which is what makes
        room at the admission bound (a stop token may end one sooner): the fewest any running
        request has left to its length limit. With no seat taken yet, the fewest among the
        requests the next steps admit."""
        holders = self.running or list(itertools.islice(self.waiting, self.config.max_num_seqs))
        if not holders:
            return 1
        return max(1, min(self._num_steps_to_length_limit(r) for r in holders))

    def set_grammar_ready(self, request_id: str) -> bool:
        """The worker has the request's grammar compiled: it may be admitted now. False for an
        id no longer held (finished, aborted)."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.grammar_ready = True
        return True

    def unpin(self, name: str) -> bool:
        """Let a pinned prefix's blocks be evicted again; False if nothing is pinned so."""
        return self.kv.unpin(name)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request; its blocks are free on return. Unknown or finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish_early(request, FinishReason.ABORT)

    def schedule(self, now: float) -> BatchPlan:
        self._expire_deadlines(now)
        plan = BatchPlan(step_id=self._step_id)
        self._step_id += 1
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(plan, budget)
        if not preempted:
            # Admitting while decodes are being evicted would only thrash the cache.
            self._schedule_waiting(plan, budget)
        plan.finished_ids, self._finished_ids = self._finished_ids, []
        plan.block_copies = self.kv.take_pending_copies()
        return plan

    def update(self, plan: BatchPlan, result: StepResult, now: float) -> list[TokenEvent]:
        """Apply the worker's sampled tokens; returns one event per request that got a token
        or finished (aborts and expiries since the last update included).

        Plans must be updated in the order they were made; with overlapped scheduling the next
        plan was already made (and its tokens counted as computed) when this result arrives.
        """
        del now  # part of the contract for timing metrics; stop conditions do not need it
        events, self._pending_events = self._pending_events, []
        finished: list[Request] = []
        for request_id in plan.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished, aborted or expired after this plan was made
            running = request.status is RequestStatus.RUNNING
            token_id = result.sampled_token_ids.get(request_id)
            if token_id is None:
                if running:
                    self.kv.cache_full_blocks(request)  # a partial prefill chunk samples nothing
                continue
            # Also for a request preempted after this plan was made: the token was computed
            # from its full context, so it stands (the resumed request recomputes its KV).
            request.num_pending_tokens -= 1
            request.output_token_ids.append(token_id)
            if running:
                self.kv.cache_full_blocks(request)
            reason = self._stop_reason(request, token_id)
            logprobs = result.logprobs.get(request_id)
            logprobs_list = [logprobs] if logprobs is not None else None
            events.append(self._event(request, [token_id], reason, logprobs_list))
            if reason is None:
                continue
            if running:
                request.finish_reason = reason
                request.status = RequestStatus.FINISHED
                finished.append(request)
            else:
                self.waiting.remove(request)
                request.finish_reason = reason
                request.status = RequestStatus.FINISHED
                self._release(request)
        if finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
            for request in finished:
                self._release(request)
        return events

    def has_unfinished_requests(self) -> bool:
        """True while anything is queued or running, or a plan/event is still owed to the
        worker or the caller (so the engine keeps stepping until aborts are delivered)."""
        return bool(self.waiting or self.running or self._finished_ids or self._pending_events)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            prefix_queried_tokens=self.kv.prefix_queried_tokens,
            prefix_hit_tokens=self.kv.prefix_hit_tokens,
            num_preemptions=self.num_preemptions,
            num_pinned_blocks=self.kv.num_pinned_blocks,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        queued = [r.request_id for r in self.waiting] + [r.request_id for r in self.running]
        assert len(queued) == len(set(queued)) == len(self.requests), "request lists disagree"
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, request.request_id
        assert len(self.running) <= self.config.max_num_seqs

    # ---- scheduling ---------------------------------------------------------------------

    def _schedule_running(self, plan: BatchPlan, budget: int) -> tuple[int, bool]:
        """Give every running request its next tokens, preempting from the back when blocks
        run out. Returns the remaining budget and whether anything was preempted."""
        num_preemptions_before = self.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_tokens_to_schedule(request, request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new)
            if new_blocks is None:
                break  # the request itself is gone, and so is everyone after it
            if new_blocks:
                plan.block_deltas.append(SequenceDelta(request.request_id, new_blocks))
            plan.num_scheduled_tokens[request.request_id] = num_new
            self._advance(request, num_new)
            budget -= num_new
            index += 1
        return budget, self.num_preemptions > num_preemptions_before

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[int] | None:
        """Blocks for a running request, preempting the latest arrivals until they fit.
        None when the request itself was preempted (or finished: it outgrew the cache)."""
        while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
            if len(self.running) == 1:
                # Alone and still short of blocks: it can never grow, so end it like
                # max_model_len would rather than preempt it into a queue it cannot leave.
                self._finish_early(request, FinishReason.LENGTH)
                return None
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None
        return new_blocks

    def _schedule_waiting(self, plan: BatchPlan, budget: int) -> None:
        """Admit waiting requests first-come first-served until budget, seats or blocks run out.
        The head blocks the queue: skipping it for smaller requests could starve it. Only a
        request whose grammar is not compiled yet is passed over (it is not runnable)."""
        index = 0
        while (
            index < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[index]
            if not request.grammar_ready:
                # Its grammar still compiles on the worker: the requests behind it go first
                # (a compile takes up to a second; the queue must not stall on it).
                index += 1
                continue
            if request.num_pending_tokens:
                # Preempted while a step that samples for it was in flight: its token arrives
                # with the next result, and must be part of the sequence it is resent as.
                break
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_new = self._num_tokens_to_schedule(request, num_cached, budget)
            # With nothing running there is no decode to keep headroom for, and insisting on
            # it could leave a long resumed request stuck at the head of the queue forever.
            new_blocks = self.kv.allocate_slots(
                request, num_new, computed_blocks, reserve_watermark=bool(self.running)
            )
            if new_blocks is None:
                break
            del self.waiting[index]
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            bisect.insort(self.running, request, key=lambda r: self._priority[r.request_id])
            self._on_worker.add(request.request_id)
            plan.new_sequences.append(
                NewSequence(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids,
                    num_prompt_tokens=request.num_prompt_tokens,
                    block_ids=list(self.kv.get_block_table(request.request_id)),
                    num_computed_tokens=num_cached,
                    sampling=request.sampling,
                )
            )
            plan.num_scheduled_tokens[request.request_id] = num_new
            self._advance(request, num_new)
            budget -= num_new

    @staticmethod
    def _advance(request: Request, num_new: int) -> None:
        """Count scheduled tokens as computed now, so the next plan can be made before this
        one's result arrives; a step that reaches the sequence's end samples a pending token."""
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens_with_pending:
            request.num_pending_tokens += 1

    def _num_tokens_to_schedule(self, request: Request, num_computed: int, budget: int) -> int:
        if (
            request.num_output_tokens_with_pending >= request.sampling.max_new_tokens
            or request.num_tokens_with_pending >= self.config.max_model_len
        ):
            return 0  # its last token is already being sampled: it finishes on that result
        num_new = request.num_tokens_with_pending - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def _num_steps_to_length_limit(self, request: Request) -> int:
        """One step per output token still to come before max_new_tokens or max_model_len,
        plus one for a prompt not computed yet (a long one in chunks takes more)."""
        num_left = min(
            request.sampling.max_new_tokens - request.num_output_tokens_with_pending,
            self.config.max_model_len - request.num_tokens_with_pending,
        )
        num_prefill_steps = 1 if request.num_computed_tokens < request.num_prompt_tokens else 0
        return num_prefill_steps + max(num_left, 0)

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the KV, requeue at the front, resend it whole later."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._drop_from_worker(request.request_id)
        self.waiting.appendleft(request)

    def _expire_deadlines(self, now: float) -> None:
        expired = [
            r
            for queue in (self.waiting, self.running)
            for r in queue
            if r.deadline is not None and r.deadline <= now
        ]
        for request in expired:
            self._finish_early(request, FinishReason.DEADLINE)

    # ---- finishing ----------------------------------------------------------------------

    def _finish_early(self, request: Request, reason: FinishReason) -> None:
        """Finish a request outside update() (abort, deadline); its event goes out next update."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._pending_events.append(self._event(request, [], reason, None))
        self._release(request)

    def _release(self, request: Request) -> None:
        if request.pin_name is not None and request.finish_reason in _COMPLETED:
            # Before free(): the blocks must not pass through the free queue in between.
            self.kv.pin(request.pin_name, request)
        self.kv.free(request)
        self._drop_from_worker(request.request_id)
        del self.requests[request.request_id]
        del self._priority[request.request_id]

    def _drop_from_worker(self, request_id: str) -> None:
        if request_id in self._on_worker:
            self._on_worker.discard(request_id)
            self._finished_ids.append(request_id)

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        sampling = request.sampling
        if request.num_output_tokens > sampling.min_new_tokens and (
            token_id in sampling.stop_token_ids
            or (not sampling.ignore_eos and token_id in request.eos_token_ids)
        ):
            return FinishReason.STOP
        if (
            request.num_output_tokens >= sampling.max_new_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _event(
        request: Request,
        token_ids: list[int],
        reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None,
    ) -> TokenEvent:
        return TokenEvent(
            request_id=request.request_id,
            new_token_ids=token_ids,
            finish_reason=reason,
            logprobs=logprobs or [],
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )
