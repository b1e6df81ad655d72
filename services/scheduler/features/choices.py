"""Requests with n > 1 choices: how their prompt is computed once and shared.

Choice 0 prefills all but the prompt's last token, then forks choices 1..n-1, which share its
block table (reference counts); each choice then computes the last prompt token itself, a
one-token step like a decode, and samples its own first token. The partial last block is
copied on the first write of each choice but the last to write it (copy-on-write,
`BatchPlan.block_copies`):

    prompt:   [ block 0 (full) | block 1 (full) | block 2: t32..t38 . | t39 ]
    choice 0: ─ prefill t0..t38 ──────────────────────────────────────▶ fork
    choice i:   block 0, 1 shared │ block 2 copied, then t39 computed, first token sampled

Needing no worker change is why: a worker samples one token per sequence per step, and here
each choice's first token comes from its own step. A forked choice is then an ordinary
sequence (preempted, it is recomputed alone); its events go out under the request's id with
its index, and the request ends when its last choice does. The scheduler core asks
`ChoiceForks` to fork a running choice 0 or split a waiting one (its prompt is cached, or its
blocks cannot be shared), and hands it the lists it edits.

Seats: admitting choice 0 reserves a seat for each of its unforked choices at once, so forks
never wait for seats (two half-admitted requests could otherwise each wait for the other's).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from services.contracts.step import FinishReason, TokenEvent
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import ChoiceGroup, Request, RequestStatus, choice_request_id

_INT64_MAX = 2**63 - 1


def new_choice(first: Request, index: int) -> Request:
    """Choice `index` of `first`'s request: the same prompt and limits, seed + index; added
    to the request's group."""
    group = first.group
    assert group is not None
    sampling = first.sampling
    if sampling.seed is not None:
        # vLLM's rule, so each choice is reproducible alone; wrapped into int64 (the protos'
        # type) for a seed near the top of the range.
        seed = sampling.seed + index
        sampling = replace(sampling, seed=seed - 2**64 if seed > _INT64_MAX else seed)
    choice = Request(
        request_id=choice_request_id(first.request_id, index),
        prompt_token_ids=first.prompt_token_ids,
        sampling=sampling,
        eos_token_ids=first.eos_token_ids,
        arrival_time=first.arrival_time,
        deadline=first.deadline,
        cache_salt=first.cache_salt,
        tenant_id=first.tenant_id,
        tenant_weight=first.tenant_weight,
        lora_name=first.lora_name,
        group=group,
        choice_index=index,
    )
    group.choices.append(choice)
    return choice


Priority = tuple[float, int]
"""A request's place in line: arrival time, then submission order."""


class ChoiceForks:
    """The requests with n > 1 held, by the submitted id, until their last choice finishes,
    and the seats their unforked choices reserve.

    It shares the scheduler's id -> request and id -> priority maps (a forked choice is a
    request like any other there) and edits the queue lists it is handed; it never calls
    back into the scheduler.
    """

    def __init__(
        self, kv: KVCacheManager, requests: dict[str, Request], priority: dict[str, Priority]
    ) -> None:
        self.kv = kv
        self.requests = requests
        self.priority = priority
        self.groups: dict[str, ChoiceGroup] = {}
        self.num_reserved_seats = 0

    def add(self, request: Request) -> None:
        """Make `request` (n > 1, just queued) choice 0 of its group."""
        n = request.sampling.n
        group = ChoiceGroup(request.request_id, n, [request], num_unfinished=n)
        request.group = group
        self.groups[request.request_id] = group

    def live_choices(self, request_id: str) -> list[Request]:
        """The created choices of a request with n > 1 not finished yet ([] for others)."""
        group = self.groups.get(request_id)
        if group is None:
            return []
        return [choice for choice in group.choices if not choice.is_finished]

    def choice(self, request_id: str, index: int) -> Request | None:
        """Choice `index` of a request, when created and not finished."""
        group = self.groups.get(request_id)
        if group is None or not 0 <= index < len(group.choices):
            return None
        choice = group.choices[index]
        return None if choice.is_finished else choice

    def num_blocks_to_fork(self, first: Request) -> int:
        return self.kv.num_blocks_to_fork(first) * first.num_unforked_choices

    def fork(self, first: Request, running: list[Request], position: int) -> None:
        """Create the unforked choices of the running `first` (its prompt computed up to the
        last token) right after it (at `position`) in `running`, sharing its blocks."""
        assert first.group is not None
        self.num_reserved_seats -= first.num_unforked_choices
        for index in range(len(first.group.choices), first.group.n):
            choice = self._new_choice(first, index)
            self.kv.fork(first.request_id, choice.request_id, first.num_computed_tokens)
            choice.status = RequestStatus.RUNNING
            choice.num_computed_tokens = first.num_computed_tokens
            choice.num_cached_tokens = first.num_cached_tokens
            position += 1
            running.insert(position, choice)

    def split(self, first: Request, waiting: deque[Request], position: int) -> None:
        """Queue the unforked choices of the waiting `first` as sequences of their own, at
        `position` in `waiting` (right behind it)."""
        assert first.group is not None
        for index in range(len(first.group.choices), first.group.n):
            waiting.insert(position, self._new_choice(first, index))
            position += 1

    def note_finished(self, request: Request) -> None:
        if request.group is not None:
            request.group.num_unfinished -= 1

    def end_unforked(
        self, first: Request, reason: FinishReason, held_seats: bool
    ) -> list[TokenEvent]:
        """`first` ended before forking: its unforked choices end with it, for the same
        reason. Returns their events, and gives back their seats if `first` was running."""
        group = first.group
        if group is None or not first.num_unforked_choices:
            return []
        if held_seats:
            self.num_reserved_seats -= first.num_unforked_choices
        events = []
        for index in range(len(group.choices), group.n):
            group.num_unfinished -= 1
            events.append(
                TokenEvent(
                    request_id=group.request_id,
                    new_token_ids=[],
                    finish_reason=reason,
                    num_prompt_tokens=first.num_prompt_tokens,
                    num_cached_tokens=first.num_cached_tokens,
                    index=index,
                    num_unfinished_choices=group.num_unfinished,
                )
            )
        return events

    def release(self, request: Request) -> None:
        """`request` left the scheduler: its group goes once no choice is left."""
        if request.group is not None and request.group.num_unfinished == 0:
            self.groups.pop(request.group.request_id, None)

    def check_integrity(self, running: list[Request], max_num_seqs: int) -> None:
        reserved = sum(r.num_unforked_choices for r in running)
        assert reserved == self.num_reserved_seats, (reserved, self.num_reserved_seats)
        assert len(running) + reserved <= max_num_seqs
        for group in self.groups.values():
            live = [c for c in group.choices if not c.is_finished]
            assert group.num_unfinished > 0, group.request_id
            assert all(self.requests.get(c.request_id) is c for c in live), group.request_id

    def _new_choice(self, first: Request, index: int) -> Request:
        choice = new_choice(first, index)
        self.requests[choice.request_id] = choice
        # The request's place in line: a choice is never preempted before its own choice 0.
        self.priority[choice.request_id] = self.priority[first.request_id]
        return choice
