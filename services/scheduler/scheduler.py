"""Iteration-level scheduler: `schedule(now) -> BatchPlan`, then `update(...) -> events`, per step.

No prefill phase: every request has num_computed_tokens and num_tokens, and a step gives each
scheduled request a slice of the token budget (a decode takes 1, a prompt takes a chunk).

This core decides who runs in a step; the request book (request_book.py) carries out the
moves between queues and frees what each one must. Features live in features/, one object
each, called at named points and keeping their own state by request id: n > 1 choices
(choices.py), draft slots (draft_slots.py), pinned prefixes (pins.py), fair shares
(fair_share.py: whom to admit, preempt and queue), LoRA admission, grammar readiness, remote
prefills and prefix fetches (disaggregation.py: reserve, await KV, never preempt), prefix
exports (kv_exports.py), the KV disk tier (kv_disk.py). Each gets the KV manager and the lists
it edits, never the scheduler.
"""

from __future__ import annotations

import itertools

from services.contracts.errors import InvalidRequestError
from services.contracts.kv_transfer import KvDestination
from services.contracts.step import BatchPlan, FinishReason, SequenceDelta, StepResult, TokenEvent
from services.scheduler.config import SchedulerConfig
from services.scheduler.features import admission
from services.scheduler.features.choices import ChoiceForks
from services.scheduler.features.disaggregation import Handoff, RemotePrefills
from services.scheduler.features.draft_slots import DraftSlots
from services.scheduler.features.fair_share import NO_TENANT, FairShare, Tenant
from services.scheduler.features.grammar_readiness import GrammarReadiness
from services.scheduler.features.kv_disk import DiskTierView
from services.scheduler.features.kv_exports import KvExports
from services.scheduler.features.lora_admission import LoraAdmission
from services.scheduler.features.pins import PinnedPrefixes
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus
from services.scheduler.request_book import HeldState, RequestBook
from services.scheduler.stats import SchedulerStats


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        *,
        sliding_window: int = 0,
        max_loras: int = 0,
        kv_disk_hashes: list[bytes] | None = None,
    ) -> None:
        """`num_blocks`, `sliding_window` and `max_loras` are the worker's: its KV capacity,
        the window every layer of its model attends through (0: some layer sees the whole
        context), the LoRA adapters one of its steps may mix, and the blocks its KV disk
        tier holds (None: it has no disk tier)."""
        self.config = config
        self.kv = KVCacheManager.from_config(config, num_blocks, sliding_window)
        self.requests: dict[str, Request] = {}
        self._priority: dict[str, tuple[float, int]] = {}
        self._step_id = 0
        self.choices = ChoiceForks(self.kv, self.requests, self._priority)
        # Speculative decoding: which decodes of the plan being made may draft, and how many.
        self.drafts = DraftSlots(config, self.kv)
        self.pins = PinnedPrefixes(self.kv, config.max_pinned_fraction)
        self.fair = FairShare(config.fair_share, public_id=self.choices.public_id)
        self.loras = LoraAdmission(max_loras)
        self.grammars = GrammarReadiness()
        self.disk = None if kv_disk_hashes is None else DiskTierView(kv_disk_hashes)
        self.kv.disk = self.disk
        self.remote = RemotePrefills()
        self.exports = KvExports(self.kv.pool, config.block_size, self.disk)
        held = HeldState(
            self.choices, self.drafts, self.pins, self.fair, self.grammars, self.remote
        )
        self.book = RequestBook(config, self.kv, self.requests, self._priority, held)
        # The book's lists and dict, edited in place only: these names stay theirs.
        book = self.book
        self.waiting, self.running, self.failures = book.waiting, book.running, book.failures

    # ---- the callers' API ---------------------------------------------------------------

    def add_request(
        self,
        request: Request,
        *,
        tenant: Tenant = NO_TENANT,
        grammar_pending: bool = False,
        pin_name: str | None = None,
        prefill_scheduler: str = "",
        kv_destination: KvDestination | None = None,
        num_prefix_tokens: int = 0,
    ) -> None:
        """Queue a request. Raises QueueFullError (back off) or CapacityError (never fits).
        `tenant`: whose fair share it uses; `grammar_pending`: it waits until
        `set_grammar_ready` (the worker compiles it); `pin_name`: once completed, its
        prompt's blocks stay pinned under that name. `prefill_scheduler`: its prompt's KV
        comes from that prefill scheduler (disaggregation.py), or with `num_prefix_tokens`
        only that prefix's, from its cache; `kv_destination`: its prompt's KV goes there
        once computed."""
        if request.request_id in self.requests or request.request_id in self.choices.groups:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already queued")
        admission.check_servable(request, self.config, self.kv)
        self.loras.check_servable(request)
        self.fair.note(tenant, itertools.chain(self.waiting, self.running))
        bound = self.max_num_unfinished_requests
        if self.num_unfinished_requests >= bound and not self.fair.may_exceed_bound(
            tenant, [*self.waiting, *self.running], bound
        ):
            raise admission.queue_full(len(self.waiting), len(self.running), self.config)
        self.book.queue(request)
        self.fair.on_queued(request.request_id, tenant)
        if grammar_pending:
            self.grammars.hold(request.request_id)
        if pin_name is not None:
            self.pins.pin_on_finish(request.request_id, pin_name)
        if prefill_scheduler:
            self.remote.hold(request.request_id, prefill_scheduler, num_prefix_tokens)
        if kv_destination is not None:
            self.remote.send_to(request.request_id, kv_destination)
        self.choices.on_queued(request, self.waiting)

    @property
    def num_unfinished_requests(self) -> int:
        return self.book.num_unfinished

    @property
    def num_preemptions(self) -> int:
        return self.book.num_preemptions

    @property
    def max_num_unfinished_requests(self) -> int:
        """The admission bound: seats plus queue (admission.py says why)."""
        return admission.max_num_unfinished_requests(self.config)

    def num_steps_until_a_seat_frees(self) -> int:
        """For the retry hint of a refusal at the admission bound (retry_hint.py)."""
        return admission.steps_until_a_seat_frees(self.running, self.waiting, self.config)

    def set_grammar_ready(self, request_id: str) -> bool:
        """The worker has the request's grammar compiled: it may be admitted now. False for an
        id no longer held (finished, aborted)."""
        self.grammars.ready(request_id)
        return request_id in self.requests

    def abort_request(self, request_id: str) -> None:
        """Cancel a request (every choice of it); its blocks are free on return. Unknown or
        finished ids are ignored."""
        self.book.abort(request_id)

    def abort_choice(self, request_id: str, index: int) -> None:
        """End one forked choice of a request with n > 1 (its text hit a stop string); the
        others go on. Its blocks are free on return; unknown, unforked or finished choices
        are ignored."""
        choice = self.choices.choice(request_id, index)
        if choice is not None:
            self.book.finish_early(choice, FinishReason.ABORT)

    def take_handoffs(self) -> list[Handoff]:
        """Requests admitted since the last call whose KV a prefill scheduler is to send."""
        return self.remote.take_new_handoffs()

    def complete_remote_prefill(self, request_id: str, token_ids: list[int]) -> None:
        """The prompt's KV and first token came, or a fetched prefix's KV (request_book.py)."""
        self.book.complete_remote_prefill(request_id, token_ids)

    def fall_back_to_local_prefill(self, request_id: str) -> None:
        """The prefill pair failed: the request prefills here, in the blocks it holds."""
        self.book.fall_back_to_local_prefill(request_id)

    def schedule(self, now: float) -> BatchPlan:
        self.book.expire_deadlines(now)
        plan = BatchPlan(step_id=self._step_id)
        self._step_id += 1
        budget = self.config.max_num_batched_tokens
        self.drafts.start_plan()
        self._free_seats_for_fair_shares()
        budget, preempted = self._schedule_running(plan, budget)
        if not preempted:
            # Admitting while decodes are being evicted would only thrash the cache.
            self._schedule_waiting(plan, budget)
        self.drafts.grant(plan, self.requests)
        plan.finished_request_ids = self.book.take_dropped_ids()
        plan.block_copies = self.kv.take_pending_copies()
        if self.disk is not None:
            plan.disk_stores = self.disk.take_stores()
        plan.kv_exports = self.exports.take()
        return plan

    def update(self, plan: BatchPlan, result: StepResult, now: float) -> list[TokenEvent]:
        """Apply the worker's sampled tokens; returns one event per request that got a token
        or finished (aborts and expiries since the last update included).

        Plans must be updated in the order they were made; with overlapped scheduling the next
        plan was already made (and its tokens counted as computed) when this result arrives.
        """
        del now  # part of the contract for timing metrics; stop conditions do not need it
        events, self.book.pending_events = self.book.pending_events, []
        if self.disk is not None:
            # First: a request whose disk blocks failed is readmitted without them.
            self.disk.on_result(result)
        if result.failed_sequences:
            self.book.fail(result.failed_sequences)
        finished: list[Request] = []
        for request_id in plan.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished, aborted or expired after this plan was made
            running = request.status is RequestStatus.RUNNING
            self.drafts.on_result(plan, result, request_id)
            token_ids = result.token_ids(request_id)
            if not token_ids:
                if running:
                    self.kv.cache_full_blocks(request)  # a partial prefill chunk samples nothing
                continue
            # Also for a request preempted after this plan was made: the tokens were computed
            # from its full context, so they stand (the resumed request recomputes its KV).
            request.num_pending_tokens -= 1
            if running:
                # Accepted drafts' KV was written in this step; a rejected draft's lies past
                # the end, where the next tokens overwrite it.
                request.num_computed_tokens += len(token_ids) - 1
            emitted, reason = request.append_output(token_ids, self.config.max_model_len)
            if running:
                self.kv.cache_full_blocks(request)
            logprobs = [lp] if (lp := result.logprobs.get(request_id)) is not None else None
            events.append(self.choices.event(request, emitted, reason, logprobs))
            if reason is None:
                continue
            self.book.finish(request, reason)
            if running:
                finished.append(request)
            else:
                self.waiting.remove(request)
                self.book.release(request)
        if finished:
            self.running[:] = [r for r in self.running if r.status is RequestStatus.RUNNING]
            for request in finished:
                self.book.release(request)
        if self.config.debug_checks:
            self.check_integrity()
        return events

    def has_unfinished_requests(self) -> bool:
        """True while anything is queued or running, or a plan/event is still owed to the
        worker or the caller (so the caller keeps stepping until aborts are delivered)."""
        # Requests awaiting their KV are left out: the handoff's end wakes the loop.
        num_runnable = len(self.running) - self.remote.num_awaiting
        return bool(
            self.waiting
            or num_runnable
            or self.book.dropped_ids
            or self.book.pending_events
            or (self.disk is not None and self.disk.has_stores)
            or self.exports.has_pending
        )

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats.of(self)

    def observe_step(self, plan: BatchPlan, result: StepResult, seconds: float) -> None:
        """The worker took `seconds` for this plan (speculation learns its step cost)."""
        self.drafts.observe_step(plan, result, seconds)

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.pins.tables())
        self.book.check_integrity()
        self.choices.check_integrity(self.running, self.config.max_num_seqs)

    # ---- scheduling ---------------------------------------------------------------------

    def _schedule_running(self, plan: BatchPlan, budget: int) -> tuple[int, bool]:
        """Give every running request its next tokens, preempting from the back when blocks
        run out. Returns the remaining budget and whether anything was preempted."""
        num_preemptions_before = self.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self.remote.is_awaiting(request):
                index += 1  # its KV comes from a prefill pair
                continue
            if self.choices.due_to_fork(request) and not self._fork(request, index, budget):
                if request.is_finished:
                    break  # it could never fork: ended, and everyone after it is gone
                index += 1
                continue
            num_new = self._num_tokens_to_schedule(request, request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            # Drafts of plans in flight may have been accepted: the worker's sequence can be
            # that much further along than this one, and the step writes there.
            new_blocks = self._allocate_or_preempt(
                request, index, num_new + self.drafts.num_unconfirmed(request.request_id)
            )
            if new_blocks is None:
                break  # the request itself is gone, and so is everyone after it
            self._add_to_plan(plan, request, num_new, new_blocks)
            budget -= num_new
            index += 1
        return budget, self.num_preemptions > num_preemptions_before

    def _allocate_or_preempt(
        self, request: Request, position: int, num_new: int
    ) -> list[int] | None:
        """Blocks for the running request at `position`, preempting requests after it (not
        scheduled in this step yet; the fair shares choose whom) until they fit. None when the
        request itself was preempted (or finished: it outgrew the cache)."""
        while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
            if len(self.running) == 1:
                # Alone and still short of blocks: it can never grow, so end it like
                # max_model_len would rather than preempt it into a queue it cannot leave.
                self.book.finish_early(request, FinishReason.LENGTH)
                return None
            if self._preempt_after(position) is request:
                return None
        return new_blocks

    def _schedule_waiting(self, plan: BatchPlan, budget: int) -> None:
        """Admit waiting requests until budget, seats or blocks run out, first come first
        served (with several tenants, in their fair order: fair_share.py). The next in order
        blocks the rest: skipping it for smaller requests could starve it. Only a request
        whose grammar is not compiled yet is passed over (it is not runnable)."""
        max_num_seqs = self.config.max_num_seqs
        passed_over: set[str] = set()
        self.loras.start_admission(self.running)
        while budget > 0 and self._num_seats_taken < max_num_seqs:
            request = self.fair.next_to_admit(self.waiting, self.running, passed_over)
            if request is None:
                break
            if not self.grammars.is_ready(request) or not self.loras.admits(request):
                # Its grammar still compiles on the worker, or every LoRA slot holds another
                # adapter: the requests behind it go first (the queue must not stall on it).
                passed_over.add(request.request_id)
                continue
            if request.num_pending_tokens:
                # Preempted while a step that samples for it was in flight: its token arrives
                # with the next result, and must be part of the sequence it is resent as.
                break
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            disk_hits = self._disk_hits(request, len(computed_blocks))
            num_from_disk = len(disk_hits) * self.config.block_size
            remote = self.remote.wants_remote(request, num_cached + num_from_disk)
            if remote:  # the other pair sends every block after the pool's
                disk_hits, num_from_disk = [], 0
            num_cached += num_from_disk
            self.choices.before_admission(request, num_cached, self.waiting)
            if self._num_seats_taken + 1 + self.choices.num_unforked(request) > max_num_seqs:
                break
            if remote:
                num_new = self.remote.num_tokens_to_reserve(request, num_cached)
            else:
                num_new = self._num_tokens_to_schedule(request, num_cached, budget)
            # With nothing running there is no decode to keep headroom for, and insisting on
            # it could leave a long resumed request stuck at the head of the queue forever.
            # Blocks loaded from disk are new blocks to the pool, filled before the forward.
            new_blocks = self.kv.allocate_slots(
                request,
                num_from_disk + num_new,
                computed_blocks,
                reserve_watermark=bool(self.running),
            )
            if new_blocks is None:
                break
            if disk_hits:
                plan.disk_loads[request.request_id] = list(
                    zip(new_blocks[: len(disk_hits)], disk_hits, strict=True)
                )
            self.book.admit(request, num_cached)
            self.loras.note_admitted(request)
            if remote:
                block_table = self.kv.get_block_table(request.request_id)
                self.remote.on_reserved(request, num_cached, self.config.block_size, block_table)
                continue  # computes nothing here: no budget spent
            self._add_to_plan(plan, request, num_new, new_blocks)
            budget -= num_new

    def _disk_hits(self, request: Request, num_pool_blocks: int) -> list[bytes]:
        """The prefix blocks after the pool's hits that the worker's KV disk tier holds (none
        for a remote prefill: its blocks are written by the prefill worker)."""
        if self.disk is None or self.remote.prefills_whole(request):
            return []
        return self.disk.hits(self.kv.uncached_block_hashes(request, num_pool_blocks))

    @property
    def _num_seats_taken(self) -> int:
        return len(self.running) + self.choices.num_reserved_seats

    def _add_to_plan(
        self, plan: BatchPlan, request: Request, num_new: int, new_blocks: list[int]
    ) -> None:
        """Schedule `num_new` tokens of a running request: sent whole the first time the
        worker sees it (admitted, resumed or forked), as a block delta after that."""
        if not self.book.send_whole(request.request_id):
            if new_blocks:
                plan.block_deltas.append(SequenceDelta(request.request_id, new_blocks))
        else:
            block_table = self.kv.get_block_table(request.request_id)
            destination = self.remote.destination(request.request_id)
            plan.new_sequences.append(request.new_sequence(block_table, destination))
        plan.num_scheduled_tokens[request.request_id] = num_new
        if num_new == 1 and request.num_computed_tokens + 1 == request.num_tokens_with_pending:
            self.drafts.note_decode(request)  # it samples this step: it may also draft
        request.advance(num_new)

    def _fork(self, first: Request, position: int, budget: int) -> bool:
        """Fork the choices of the running `first` (choices.py) if the budget holds their
        first steps and free blocks their copies of the partial block, preempting requests
        after `first` (later arrivals) if needed. False when they do not fit this step; a
        request alone that cannot fork ends with "length", like one that cannot grow."""
        if budget < self.choices.num_tokens_to_fork(first):
            return False
        needed = self.choices.num_blocks_to_fork(first)
        while self.kv.num_free_blocks < needed:
            if len(self.running) == 1:
                self.book.finish_early(first, FinishReason.LENGTH)
                return False
            if len(self.running) - 1 <= position:
                return False  # only earlier arrivals hold blocks: wait for them to finish
            self._preempt_after(position)
        self.choices.fork(first, self.running, position)
        return True

    def _num_tokens_to_schedule(self, request: Request, num_computed: int, budget: int) -> int:
        if (
            request.num_output_tokens_with_pending >= request.sampling.max_new_tokens
            or request.num_tokens_with_pending >= self.config.max_model_len
        ):
            return 0  # its last token is already being sampled: it finishes on that result
        num_new = request.num_tokens_with_pending - num_computed
        num_new = self.choices.limit_prefill(request, num_computed, num_new)
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def _free_seats_for_fair_shares(self) -> None:
        """Every seat taken while a tenant under its share waits: preempt from the tenants
        most over theirs (fair_share.py), before this step's plan schedules anyone."""
        num_free = max(0, self.config.max_num_seqs - self._num_seats_taken)
        for victim in self.fair.seats_to_free(
            self.waiting, self.running, self.config.max_num_seqs, num_free, self.grammars.is_ready
        ):
            if not self.remote.is_awaiting(victim):
                self.book.preempt(victim)

    def _preempt_after(self, position: int) -> Request:
        """Preempt one of the running requests after `position` (the one there when none
        is): the latest arrival, or with several tenants the fair shares' choice."""
        # Never one awaiting its KV: the transfer would land in blocks given to someone else.
        later = [r for r in self.running[position + 1 :] if not self.remote.is_awaiting(r)]
        candidates = later or self.running[position : position + 1]
        return self.book.preempt(self.fair.victim(self.running, candidates))
