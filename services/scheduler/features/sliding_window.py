"""Which of a sequence's KV blocks no future query can see, in a model whose every layer attends
through a sliding window W (a query at position p sees keys p - W < j <= p).

Once num_computed_tokens = n, every later query sits at a position >= n and sees keys > n - W,
so a block is dead once its last position is <= n - W:

    positions   0 ........................ n-W | n-W+1 ........... n-1 | n (next query)
    blocks     [ b0 ][ b1 ][ b2 ] ... dead ... | window: held .........|
                                 (b+1)*bs <= n - W + 1
"""

from __future__ import annotations

RELEASED_BLOCK = -1
"""A block-table entry whose block went back to the pool: the sequence no longer holds it."""


def num_dead_blocks(num_computed_tokens: int, sliding_window: int, block_size: int) -> int:
    """How many leading blocks lie wholly before the window of every query at a position
    >= num_computed_tokens. Always 0 without a window (sliding_window 0)."""
    if sliding_window <= 0:
        return 0
    first_visible = num_computed_tokens - sliding_window + 1
    return max(0, first_visible // block_size)
