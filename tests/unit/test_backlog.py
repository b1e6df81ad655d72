"""The shared backlog batching: leading mergeable items, none past an ending one."""

from __future__ import annotations

from collections import deque

from services.common.backlog import take_leading


def take(backlog: deque[object]) -> list[object]:
    return take_leading(
        backlog,
        mergeable=lambda item: isinstance(item, int),
        ends_batch=lambda item: item < 0,
    )


def test_takes_leading_items_and_stops_at_the_first_unmergeable_one() -> None:
    backlog: deque[object] = deque([1, 2, "error", 3])
    assert take(backlog) == [1, 2]
    assert list(backlog) == ["error", 3]
    assert take(backlog) == []


def test_an_ending_item_closes_the_batch() -> None:
    backlog: deque[object] = deque([1, -2, 3])
    assert take(backlog) == [1, -2]
    assert take(backlog) == [3]
    assert take(deque()) == []
