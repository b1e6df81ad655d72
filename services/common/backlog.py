"""Taking what a slow reader let pile up in a stream's queue as one batch: the scheduler's
Submit stream (token events) and the tokenizer tier's reading of it (Submit responses) both
send a backlog on merged, and both stop at the same kinds of items."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any


def take_leading(
    backlog: deque[Any], mergeable: Callable[[Any], bool], ends_batch: Callable[[Any], bool]
) -> list[Any]:
    """Pops the leading items of `backlog` for which `mergeable` holds (an error, the
    stream's end or a deadline finish is not, and stays in place), and none past the first
    for which `ends_batch` holds (a finish)."""
    batch: list[Any] = []
    while backlog and mergeable(backlog[0]):
        item = backlog.popleft()
        batch.append(item)
        if ends_batch(item):
            break
    return batch
