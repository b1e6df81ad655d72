"""A request's queued token events as few Submit messages: what a slow reader let pile up goes
out as one message instead of one per token.

The step loop puts at most one TokenEvent per step on a request's queue. While the Submit
stream waits for its reader (HTTP/2 flow control), events keep arriving; the next send takes
all of them at once:

    queue:  [e1 e2 e3 | WorkerUnavailable]     →  send merge_events([e1, e2, e3]), then fail
    queue:  [e1 e2 e3(finished) ...]           →  send merge_events([e1, e2, e3]), then end

Errors and the deadline finish never merge: the tokens queued before them still go out first,
and the stream then ends with their status code, exactly as without merging.

A request with n > 1 choices has one queue for all of them: a batch goes out as one message
per choice (`merge_by_choice`), and only the last choice's finish ends the stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import chain

from services.common.backlog import take_leading
from services.contracts.step import FinishReason, TokenEvent

QueueItem = TokenEvent | BaseException


def merge_events(events: Sequence[TokenEvent]) -> TokenEvent:
    """Consecutive events of one request as one: ids and logprobs in order, the last finish."""
    if not events:
        raise ValueError("no events to merge")
    if len(events) == 1:
        return events[0]
    last = events[-1]
    return TokenEvent(
        request_id=last.request_id,
        new_token_ids=list(chain.from_iterable(e.new_token_ids for e in events)),
        finish_reason=last.finish_reason,
        logprobs=list(chain.from_iterable(e.logprobs for e in events)),
        # The request's counters as of the last event (the scheduler repeats them on each).
        num_prompt_tokens=last.num_prompt_tokens,
        num_cached_tokens=last.num_cached_tokens,
        index=last.index,
        num_unfinished_choices=last.num_unfinished_choices,
    )


def merge_by_choice(events: Sequence[TokenEvent]) -> list[TokenEvent]:
    """One merged event per choice, in the order the choices first appear (their order
    between choices carries no meaning: each choice is its own stream of text)."""
    by_index: dict[int, list[TokenEvent]] = {}
    for event in events:
        by_index.setdefault(event.index, []).append(event)
    return [merge_events(group) for group in by_index.values()]


def take_batch(backlog: deque[QueueItem]) -> list[TokenEvent]:
    """Pops the leading events of `backlog` that go out together: up to an error or a
    deadline finish (left in place: each ends the stream with a status code of its own), and
    never past the request's finish (its last choice's). Empty when the head is such an
    error or deadline finish."""
    return take_leading(
        backlog,
        mergeable=lambda head: (
            isinstance(head, TokenEvent) and head.finish_reason is not FinishReason.DEADLINE
        ),
        ends_batch=lambda event: event.request_finished,
    )
