"""The requests a scheduler holds, in their queues, and every move between them.

The scheduler core (scheduler.py) decides who runs in a step and who is preempted; the book
carries out the moves (queue, admit, preempt, finish, release, fail) so that each one frees
what it must: KV blocks, every feature's state for the request, the worker's copy of its
sequence. Pure: no clock, no I/O.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from services.contracts.step import FAILED_DISK_LOAD_PREFIX, FinishReason, TokenEvent
from services.scheduler.config import SchedulerConfig
from services.scheduler.features.choices import ChoiceForks
from services.scheduler.features.disaggregation import RemotePrefills
from services.scheduler.features.draft_slots import DraftSlots
from services.scheduler.features.fair_share import FairShare
from services.scheduler.features.grammar_readiness import GrammarReadiness
from services.scheduler.features.pins import PinnedPrefixes
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class HeldState:
    """The features that keep state per held request: a release must clear each."""

    choices: ChoiceForks
    drafts: DraftSlots
    pins: PinnedPrefixes
    fair: FairShare
    grammars: GrammarReadiness
    remote: RemotePrefills


class RequestBook:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        requests: dict[str, Request],
        priority: dict[str, tuple[float, int]],
        held: HeldState,
    ) -> None:
        self.config, self.kv, self.held = config, kv, held
        self.requests = requests
        self.priority = priority
        self.waiting: deque[Request] = deque()
        # Sorted by priority (arrival, then submission order), so the preemption victim, the
        # latest arrival, is always last and never already scheduled in the current step.
        self.running: list[Request] = []
        self._num_submitted = 0
        self._on_worker: set[str] = set()  # membership only, never iterated
        self.dropped_ids: list[str] = []  # the worker must drop these in the next plan
        self.pending_events: list[TokenEvent] = []  # aborts/expiries, out with the next update
        self.num_preemptions = 0
        self.failures: dict[str, str] = {}
        """Requests (submitted ids) the worker could not run, and why: their owners hear an
        error instead of tokens (the step loop takes them after each update)."""

    @property
    def num_unfinished(self) -> int:
        """Requests held: waiting (never admitted, or preempted) or running."""
        return len(self.waiting) + len(self.running)

    def queue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.priority[request.request_id] = (request.arrival_time, self._num_submitted)
        self._num_submitted += 1
        self.waiting.append(request)

    def admit(self, request: Request, num_cached: int) -> None:
        """Waiting → running, with its first `num_cached` tokens' KV already in place."""
        self.waiting.remove(request)
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = num_cached
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        self.held.choices.on_admitted(request)
        bisect.insort(self.running, request, key=lambda r: self.priority[r.request_id])

    def send_whole(self, request_id: str) -> bool:
        """True the first time the worker is to see this sequence (it is sent whole)."""
        if request_id in self._on_worker:
            return False
        self._on_worker.add(request_id)
        return True

    def take_dropped_ids(self) -> list[str]:
        dropped, self.dropped_ids = self.dropped_ids, []
        return dropped

    def preempt(self, request: Request, *, counted: bool = True) -> Request:
        """Preempt a running request by recompute: drop its KV, requeue it at the front,
        resend it whole later. Returns it. `counted`: a preemption for the metrics."""
        self.running.remove(request)
        self.held.choices.on_preempted(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        if counted:
            request.num_preemptions += 1
            self.num_preemptions += 1
        self._drop_from_worker(request.request_id)
        self.waiting.appendleft(request)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason, request.status = reason, RequestStatus.FINISHED

    def finish_early(self, request: Request, reason: FinishReason) -> None:
        """Finish a request outside update() (abort, deadline); its event goes out next update.
        Choices it has not forked yet end with it, for the same reason."""
        was_running = request.status is RequestStatus.RUNNING
        (self.running if was_running else self.waiting).remove(request)
        self.finish(request, reason)
        choices = self.held.choices
        self.pending_events.append(choices.event(request, [], reason))
        self.pending_events.extend(choices.end_unforked(request, reason, was_running))
        self.release(request)

    def abort(self, request_id: str) -> None:
        """Every choice of the request ends; unknown or finished ids are ignored."""
        for request in self.held.choices.sequences(request_id):
            self.finish_early(request, FinishReason.ABORT)

    def expire_deadlines(self, now: float) -> None:
        held = [*self.waiting, *self.running]
        for request in [r for r in held if r.deadline is not None and r.deadline <= now]:
            self.finish_early(request, FinishReason.DEADLINE)

    def fail(self, failed: dict[str, str]) -> None:
        """End the sequences the worker could not take on (their adapter is gone from it),
        every choice of their request with them. Before their results are read: KV they were
        to compute is not cached."""
        for request_id, reason in failed.items():
            if (request := self.requests.get(request_id)) is None:
                continue
            if reason.startswith(FAILED_DISK_LOAD_PREFIX) and request in self.running:
                self._recompute_without_disk(request)
                continue
            public_id = self.held.choices.public_id(request)
            self.failures[public_id] = reason
            self.abort(public_id)

    def _recompute_without_disk(self, request: Request) -> None:
        """A block it was to load from disk could not be read, so the worker left it out of
        every step: requeue it at the front as never admitted. The disk's result removed those
        hashes from the view, so its next admission computes them."""
        self.preempt(request, counted=False)
        request.status = RequestStatus.WAITING
        request.num_pending_tokens = 0  # no step that was to sample for it ran it

    def complete_remote_prefill(self, request_id: str, token_ids: list[int]) -> None:
        """The prefill pair sampled `token_ids` (the first token) and its worker wrote the
        prompt's KV into the reserved blocks: the prompt counts as computed; the token goes
        out with the next update. For a prefix fetch, the prefix's KV came (no token).
        Ignored for a request no longer awaiting."""
        request = self.requests.get(request_id)
        handoff = self.held.remote.end_wait(request_id)
        if request is None or handoff is None:
            return
        if handoff.num_prefix_tokens:
            self._complete_prefix_fetch(request, handoff.num_prefix_tokens)
            return
        request.num_computed_tokens = request.num_prompt_tokens
        emitted, reason = request.append_output(token_ids[:1], self.config.max_model_len)
        self.kv.cache_full_blocks(request)
        self.pending_events.append(self.held.choices.event(request, emitted, reason))
        if reason is not None:
            self.finish(request, reason)
            self.running.remove(request)
            self.release(request)

    def _complete_prefix_fetch(self, request: Request, num_prefix_tokens: int) -> None:
        """The other pair's worker wrote the fetched prefix's KV into the reserved blocks:
        those tokens count as computed, and as cached in its usage; the rest of the prompt
        prefills here."""
        request.num_computed_tokens = request.num_cached_tokens = num_prefix_tokens
        self.kv.cache_full_blocks(request)

    def fall_back_to_local_prefill(self, request_id: str) -> None:
        """The prefill pair failed: the request prefills here, in the blocks it holds."""
        if self.held.remote.end_wait(request_id):
            self._close_transfer(request_id)

    def _close_transfer(self, request_id: str) -> None:
        """A transfer given up (fallback, abort) may still be pushed late: the worker, told
        by the id among the next plan's dropped ones (a sequence it never held), discards
        any write for it from then on, before those blocks can be anyone else's."""
        self.dropped_ids.append(request_id)

    def release(self, request: Request) -> None:
        held = self.held
        # Before free(): pinned blocks must not pass through the free queue in between.
        held.pins.on_released(request)
        self.kv.free(request)
        held.drafts.forget(request.request_id)
        held.grammars.forget(request.request_id)
        if held.remote.is_awaiting(request):
            self._close_transfer(request.request_id)
        held.remote.forget(request.request_id)
        self._drop_from_worker(request.request_id)
        del self.requests[request.request_id]
        del self.priority[request.request_id]
        if (public_id := held.choices.on_released(request)) is not None:
            held.fair.forget(public_id)  # none of its sequences is left

    def _drop_from_worker(self, request_id: str) -> None:
        if request_id in self._on_worker:
            self._on_worker.discard(request_id)
            self.dropped_ids.append(request_id)

    def check_integrity(self) -> None:
        queued_requests = [*self.waiting, *self.running]
        queued = [r.request_id for r in queued_requests]
        assert len(queued) == len(set(queued)) == len(self.requests), "request lists disagree"
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, request.request_id
        held = self.held
        # Features keep per-request state only for requests held: each forgets on release.
        for state in (held.drafts, held.grammars, held.pins, held.remote):
            assert state.request_ids() <= self.requests.keys(), type(state).__name__
        public_ids = {held.choices.public_id(r) for r in queued_requests}
        assert held.fair.request_ids() <= public_ids
