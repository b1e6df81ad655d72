"""Speculative decoding in the scheduler: which decodes of the plan being made may verify
drafts, how many, and the KV blocks those drafts need.

The scheduler core tells it each decode it plans (`note_decode`), asks it to grant slots once
the plan's other work is in (`grant`), and reports what the worker proposed and how long a
step took (`observe_drafts`, `observe_step`); the back-off policy itself is
SpeculationPolicy's. Drafts never preempt: a slot is granted only where free blocks hold its
KV, and blocks reserved for drafts no longer granted are freed. The drafts each sequence has
in flight are counted here, by sequence id.

Every step that decodes ends in one outcome (`step_outcomes`, for the metrics): `drafted`
(drafts verified), or why it drafted nothing:

    off             --no-speculation, or no draft limit (--speculative-ngram 0, no request's)
    ineligible      no decode may draft (logprobs, a seeded sampled request, no room left)
    no_budget       the step's token budget is taken by other work (prefill chunks)
    compute_bound   the policy: the step is too costly per token for drafts to pay
    low_acceptance  the policy: the decodes' drafts are accepted too rarely to pay
    no_kv_room      slots were worth it, but no free KV blocks hold them
    no_proposals    slots granted, but the worker found no guess in any context
"""

from __future__ import annotations

from services.contracts.sampling_params import MAX_SPECULATIVE_TOKENS
from services.contracts.step import BatchPlan, StepResult
from services.scheduler.config import SchedulerConfig
from services.scheduler.features.plan_edits import send_blocks, send_truncation
from services.scheduler.features.speculation_policy import SpeculationPolicy
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus

STEP_OUTCOMES = (
    "drafted",
    "off",
    "ineligible",
    "no_budget",
    "compute_bound",
    "low_acceptance",
    "no_kv_room",
    "no_proposals",
)


class DraftSlots:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.policy = SpeculationPolicy(MAX_SPECULATIVE_TOKENS)
        self._plan_decodes: list[Request] = []
        self._num_unconfirmed: dict[str, int] = {}
        """Draft slots granted per sequence in plans whose results have not arrived: the
        worker may have accepted up to that many tokens more than the scheduler has heard of,
        so KV reserved ahead must cover them too (no entry: none)."""
        self.num_draft_tokens_granted = 0
        self.num_draft_tokens_proposed = 0
        self.num_draft_tokens_accepted = 0
        self.num_speculative_steps = 0
        self.step_outcomes = dict.fromkeys(STEP_OUTCOMES, 0)
        """Steps that decoded, by outcome (running totals; see the module's docstring)."""

    def start_plan(self) -> None:
        """A new plan is being made: no decodes noted yet."""
        self._plan_decodes = []

    def note_decode(self, request: Request) -> None:
        """`request` samples in the plan being made: it may also draft."""
        self._plan_decodes.append(request)

    def grant(self, plan: BatchPlan, requests: dict[str, Request]) -> None:
        """Give the plan's decodes the draft slots the policy finds worth their cost, within
        the token budget and only where free blocks hold their KV. Blocks reserved for drafts
        no longer granted are freed."""
        decodes = [r for r in self._plan_decodes if r.status is RequestStatus.RUNNING]
        self._plan_decodes = []
        if not decodes:
            return
        caps = {r.request_id: self.cap(r) for r in decodes}
        caps = {request_id: cap for request_id, cap in caps.items() if cap > 0}
        budget = self.config.max_num_batched_tokens - plan.total_num_scheduled_tokens
        other_tokens = plan.total_num_scheduled_tokens - len(decodes)
        if not caps:
            self.step_outcomes["off" if self._is_off(decodes) else "ineligible"] += 1
        elif budget <= 0:
            self.step_outcomes["no_budget"] += 1
        else:
            slots = self.policy.draft_slots(list(caps), other_tokens, caps)
            if not slots:
                compute_bound = self.policy.is_compute_bound(len(caps), other_tokens)
                self.step_outcomes["compute_bound" if compute_bound else "low_acceptance"] += 1
            for request_id, num_slots in slots.items():
                num_slots = min(num_slots, budget)
                if num_slots <= 0:
                    break
                request = requests[request_id]
                new_blocks = self.kv.reserve_lookahead(
                    request, num_slots + self.num_unconfirmed(request_id)
                )
                if new_blocks is None:
                    continue
                send_blocks(plan, request_id, new_blocks)
                plan.draft_slots[request_id] = num_slots
                self._num_unconfirmed[request_id] = self.num_unconfirmed(request_id) + num_slots
                self.num_draft_tokens_granted += num_slots
                budget -= num_slots
            if slots and not plan.draft_slots:
                self.step_outcomes["no_kv_room"] += 1
        for request in decodes:
            # What the worker may still write: this step's token and drafts, and the drafts
            # of plans in flight whose outcome is not known yet.
            keep = request.num_computed_tokens + self.num_unconfirmed(request.request_id)
            num_kept = self.kv.trim(request, keep)
            if num_kept is not None:
                send_truncation(plan, request.request_id, num_kept)

    def _is_off(self, decodes: list[Request]) -> bool:
        """No draft limit applies: speculation is off, or the server's limit is 0 and no
        decode's request sets its own. (The core's speculative_ngram is already the limit for
        its worker: ServerConfig.scheduler_config resolved an unset --speculation.)"""
        if self.config.speculation is False:
            return True
        return self.config.speculative_ngram <= 0 and all(
            r.sampling.num_speculative_tokens is None for r in decodes
        )

    def cap(self, request: Request) -> int:
        """Most drafts a decode may verify: its request's limit (or the server's), within
        the output and context it has left counting the drafts still in flight."""
        sampling = request.sampling
        if self.config.speculation is False:
            return 0  # --no-speculation: not even a request's own num_speculative_tokens
        cap = sampling.num_speculative_tokens
        if cap is None:
            cap = self.config.speculative_ngram
        if cap <= 0 or not sampling.can_speculate:
            return 0
        ahead = self.num_unconfirmed(request.request_id)
        room_output = sampling.max_new_tokens - request.num_output_tokens_with_pending - ahead
        room_context = self.config.max_model_len - request.num_tokens_with_pending - ahead
        return max(0, min(cap, room_output, room_context))

    def num_unconfirmed(self, request_id: str) -> int:
        """Drafts of plans in flight that may have been accepted: the worker's sequence can be
        that much further along than the scheduler's."""
        return self._num_unconfirmed.get(request_id, 0)

    def on_result(self, plan: BatchPlan, result: StepResult, request_id: str) -> None:
        """`plan`'s result arrived for a sequence still held: its drafts are known now, and
        what it accepted of those it proposed (a sampled sequence's) is learnt."""
        num_proposed = result.num_proposed_drafts.get(request_id)
        if num_proposed is not None and request_id in result.sampled_token_ids:
            num_accepted = len(result.accepted_draft_ids.get(request_id, ()))
            self.observe_drafts(request_id, num_proposed, num_accepted)
        num_slots = plan.draft_slots.get(request_id, 0)
        if num_slots:
            num_left = self.num_unconfirmed(request_id) - num_slots
            if num_left:
                self._num_unconfirmed[request_id] = num_left
            else:
                self._num_unconfirmed.pop(request_id, None)

    def request_ids(self) -> set[str]:
        """The sequences it keeps state for (the core's integrity check)."""
        return set(self._num_unconfirmed)

    def observe_drafts(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        self.policy.observe_drafts(request_id, num_proposed, num_accepted)
        self.num_draft_tokens_proposed += num_proposed
        self.num_draft_tokens_accepted += num_accepted
        self.num_speculative_steps += 1

    def forget(self, request_id: str) -> None:
        """The request left: drop what the policy learnt of it and its drafts in flight."""
        self.policy.forget(request_id)
        self._num_unconfirmed.pop(request_id, None)

    def observe_step(self, plan: BatchPlan, result: StepResult, seconds: float) -> None:
        """The worker took `seconds` for `plan`: tokens computed are the scheduled ones plus
        the drafts verified (a plan of drops only is no step). A plan that granted slots has
        its outcome now: drafted, or the worker found no guess."""
        if plan.draft_slots:
            self.step_outcomes["drafted" if result.num_proposed_drafts else "no_proposals"] += 1
        if plan.num_scheduled_tokens:
            num_drafts = sum(result.num_proposed_drafts.values())
            # A sequence scheduled for one token is a decode row (or a prompt's last token,
            # which costs the same); more is a prefill chunk.
            num_prefill = sum(n for n in plan.num_scheduled_tokens.values() if n > 1)
            num_rows = plan.total_num_scheduled_tokens - num_prefill + num_drafts
            self.policy.observe_step(num_rows, seconds, num_prefill)
