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
its index, and the request ends when its last choice does. The scheduler core calls
`ChoiceForks` at named points (queued, admitted, preempted, due to fork, finished, released),
and hands it the lists it edits; which sequence is which choice of which request is kept
here, by sequence id, not on `Request`.

Seats: admitting choice 0 reserves a seat for each of its unforked choices at once, so forks
never wait for seats (two half-admitted requests could otherwise each wait for the other's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from services.contracts.step import FinishReason, TokenEvent, TokenLogprobs
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus

_INT64_MAX = 2**63 - 1

# Joins a request's id and a choice index into the forked sequence's id. A control character:
# the public doors refuse it in request ids, so a forked id never collides with a submitted one.
CHOICE_ID_SEPARATOR = "\x1f"


def choice_request_id(request_id: str, index: int) -> str:
    return f"{request_id}{CHOICE_ID_SEPARATOR}{index}"


@dataclass(slots=True, eq=False)
class ChoiceGroup:
    """The n sequences of one request with n > 1.

    Choice 0 is the submitted Request itself: it prefills the prompt up to its last token,
    then forks choices 1..n-1, which share its blocks. Every choice's events go out under
    `request_id`, with its index.
    """

    request_id: str
    n: int
    choices: list[Request] = field(default_factory=list)
    """The choices created so far, in index order (choice 0 first)."""
    num_unfinished: int = 0
    """Choices not finished yet, forked or not: the request ends when it reaches 0."""


def new_choice(first: Request, index: int) -> Request:
    """Choice `index` of `first`'s request: the same prompt and limits, seed + index."""
    sampling = first.sampling
    if sampling.seed is not None:
        # vLLM's rule, so each choice is reproducible alone; wrapped into int64 (the protos'
        # type) for a seed near the top of the range.
        seed = sampling.seed + index
        sampling = replace(sampling, seed=seed - 2**64 if seed > _INT64_MAX else seed)
    return Request(
        request_id=choice_request_id(first.request_id, index),
        prompt_token_ids=first.prompt_token_ids,
        sampling=sampling,
        eos_token_ids=first.eos_token_ids,
        arrival_time=first.arrival_time,
        deadline=first.deadline,
        cache_salt=first.cache_salt,
        lora_name=first.lora_name,
    )


Priority = tuple[float, int]
"""A request's place in line: arrival time, then submission order."""


class ChoiceForks:
    """The requests with n > 1 held, by the submitted id, until their last choice finishes;
    which group and index each of their sequences is; and the seats their unforked choices
    reserve.

    It shares the scheduler's id -> request and id -> priority maps (a forked choice is a
    request like any other there) and edits the queue lists it is handed; it never calls
    back into the scheduler. A request with n = 1 is no member: every hook leaves it be.
    """

    def __init__(
        self, kv: KVCacheManager, requests: dict[str, Request], priority: dict[str, Priority]
    ) -> None:
        self.kv = kv
        self.requests = requests
        self.priority = priority
        self.groups: dict[str, ChoiceGroup] = {}
        self._members: dict[str, tuple[ChoiceGroup, int]] = {}
        """Sequence id -> its group and choice index, while the scheduler holds it."""
        self.num_reserved_seats = 0

    # ---- hooks the core calls ----------------------------------------------------------

    def on_queued(self, request: Request, waiting: deque[Request]) -> None:
        """`request` was just queued (last in `waiting`): with n > 1 it is choice 0 of its
        group. A max-length reservation cannot be shared, so there each choice queues as a
        sequence of its own at once."""
        n = request.sampling.n
        if n <= 1:
            return
        group = ChoiceGroup(request.request_id, n, [request], num_unfinished=n)
        self.groups[request.request_id] = group
        self._members[request.request_id] = (group, 0)
        if not self.kv.is_paged:
            self._split(request, waiting, len(waiting))

    def before_admission(self, first: Request, num_cached: int, waiting: deque[Request]) -> None:
        """`first` is about to be admitted with `num_cached` prompt tokens cached. When no
        prompt token is left to compute before the last one (a one-token prompt, or a cache
        hit up to it) there is nothing to fork: the choices queue right behind it as
        sequences of their own, and take the cached blocks by their own hits."""
        if self.num_unforked(first) and num_cached >= first.num_prompt_tokens - 1:
            self._split(first, waiting, waiting.index(first) + 1)

    def on_admitted(self, request: Request) -> None:
        """Admitting choice 0 reserves a seat for each choice it will fork."""
        self.num_reserved_seats += self.num_unforked(request)

    def on_preempted(self, request: Request) -> None:
        self.num_reserved_seats -= self.num_unforked(request)

    def due_to_fork(self, request: Request) -> bool:
        """A running choice 0 whose prefill was in an earlier plan (so the shared KV is
        written before this plan's forward): all its choices start in this step, or none."""
        return bool(self.num_unforked(request)) and (
            request.num_computed_tokens == request.num_prompt_tokens - 1
        )

    def num_tokens_to_fork(self, first: Request) -> int:
        """The step's tokens the fork takes: the last prompt token, once per choice."""
        return 1 + self.num_unforked(first)

    def num_blocks_to_fork(self, first: Request) -> int:
        return self.kv.num_blocks_to_fork(first) * self.num_unforked(first)

    def fork(self, first: Request, running: list[Request], position: int) -> None:
        """Create the unforked choices of the running `first` (its prompt computed up to the
        last token) right after it (at `position`) in `running`, sharing its blocks."""
        group, _ = self._members[first.request_id]
        self.num_reserved_seats -= self.num_unforked(first)
        for index in range(len(group.choices), group.n):
            choice = self._new_choice(first, index)
            self.kv.fork(first.request_id, choice.request_id, first.num_computed_tokens)
            choice.status = RequestStatus.RUNNING
            choice.num_computed_tokens = first.num_computed_tokens
            choice.num_cached_tokens = first.num_cached_tokens
            position += 1
            running.insert(position, choice)

    def limit_prefill(self, request: Request, num_computed: int, num_new: int) -> int:
        """Choice 0 stops one token short of the prompt's end: every choice computes the
        last token itself, and samples its own first token from it."""
        if self.num_unforked(request):
            return min(num_new, request.num_prompt_tokens - 1 - num_computed)
        return num_new

    def event(
        self,
        request: Request,
        token_ids: list[int],
        reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> TokenEvent:
        """What the request's owner hears of this sequence: new tokens and/or its finish,
        under the submitted id with the choice's index (a finish counts the choice done)."""
        member = self._members.get(request.request_id)
        if member is None:
            request_id, index, num_unfinished = request.request_id, 0, int(reason is None)
        else:
            group, index = member
            if reason is not None:
                group.num_unfinished -= 1
            request_id, num_unfinished = group.request_id, group.num_unfinished
        return TokenEvent(
            request_id=request_id,
            new_token_ids=token_ids,
            finish_reason=reason,
            logprobs=logprobs or [],
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            index=index,
            num_unfinished_choices=num_unfinished,
        )

    def end_unforked(
        self, first: Request, reason: FinishReason, held_seats: bool
    ) -> list[TokenEvent]:
        """`first` ended before forking: its unforked choices end with it, for the same
        reason. Returns their events, and gives back their seats if `first` was running."""
        num_unforked = self.num_unforked(first)
        if not num_unforked:
            return []
        group, _ = self._members[first.request_id]
        if held_seats:
            self.num_reserved_seats -= num_unforked
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

    def on_released(self, request: Request) -> str | None:
        """`request` left the scheduler: its group goes once no choice is left. Returns the
        submitted id when its last sequence left (else None)."""
        member = self._members.pop(request.request_id, None)
        if member is None:
            return request.request_id
        if member[0].num_unfinished == 0:
            self.groups.pop(member[0].request_id, None)
            return member[0].request_id
        return None

    # ---- what the core asks ------------------------------------------------------------

    def public_id(self, request: Request) -> str:
        """The id its owner submitted: a forked choice's events go out under it."""
        member = self._members.get(request.request_id)
        return request.request_id if member is None else member[0].request_id

    def num_unforked(self, request: Request) -> int:
        """Choices still to fork off this sequence (only choice 0 forks; 0 once forked)."""
        member = self._members.get(request.request_id)
        if member is None or member[1] != 0:
            return 0
        group = member[0]
        return group.n - len(group.choices)

    def sequences(self, request_id: str) -> list[Request]:
        """The sequences a submitted id stands for, not finished yet: its created choices
        (n > 1), or the request itself."""
        group = self.groups.get(request_id)
        if group is None:
            request = self.requests.get(request_id)
            return [] if request is None else [request]
        return [choice for choice in group.choices if not choice.is_finished]

    def choice(self, request_id: str, index: int) -> Request | None:
        """Choice `index` of a request, when created and not finished."""
        group = self.groups.get(request_id)
        if group is None or not 0 <= index < len(group.choices):
            return None
        choice = group.choices[index]
        return None if choice.is_finished else choice

    def check_integrity(self, running: Iterable[Request], max_num_seqs: int) -> None:
        running = list(running)
        reserved = sum(self.num_unforked(r) for r in running)
        assert reserved == self.num_reserved_seats, (reserved, self.num_reserved_seats)
        assert len(running) + reserved <= max_num_seqs
        assert all(request_id in self.requests for request_id in self._members)
        for group in self.groups.values():
            live = [c for c in group.choices if not c.is_finished]
            assert group.num_unfinished > 0, group.request_id
            assert all(self.requests.get(c.request_id) is c for c in live), group.request_id

    # ---- inside ------------------------------------------------------------------------

    def _split(self, first: Request, waiting: deque[Request], position: int) -> None:
        """Queue the unforked choices of the waiting `first` as sequences of their own, at
        `position` in `waiting` (right behind it)."""
        group, _ = self._members[first.request_id]
        for index in range(len(group.choices), group.n):
            waiting.insert(position, self._new_choice(first, index))
            position += 1

    def _new_choice(self, first: Request, index: int) -> Request:
        group, _ = self._members[first.request_id]
        choice = new_choice(first, index)
        group.choices.append(choice)
        self._members[choice.request_id] = (group, index)
        self.requests[choice.request_id] = choice
        # The request's place in line: a choice is never preempted before its own choice 0.
        self.priority[choice.request_id] = self.priority[first.request_id]
        return choice
