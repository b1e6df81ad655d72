"""Draft tokens by prompt lookup: continue the context the way it went after the last time its
most recent n tokens appeared (n-gram speculation, no draft model).

Pure Python, one index per sequence, updated as tokens are accepted:

    tokens:  ... a b c d e ... x y a b c | ?          suffix "a b c" (n = 3) was seen before,
                 ^------^ earlier match               so propose "d e ..." (up to k tokens)

For every position the index remembers, per n in [min_n, max_n], where that n-gram last ended
before it; proposing is then max_n - min_n + 1 dictionary reads, whatever the context length.
Longer matches are tried first: they predict better. The most recent earlier occurrence is
used, which is where an answer that copies its context is most likely copying from.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """The n-grams of one sequence's tokens and, for its current end, where each suffix of
    length n last occurred before."""

    __slots__ = ("_last_end", "_previous_end", "max_n", "min_n", "tokens")

    def __init__(self, min_n: int, max_n: int, tokens: Iterable[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # (n-gram) -> end index (exclusive) of its latest occurrence.
        self._last_end: dict[tuple[int, ...], int] = {}
        # n -> end of the previous occurrence of the current length-n suffix (None: unseen).
        self._previous_end: dict[int, int | None] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(self.tokens[end - n : end])
                self._previous_end[n] = self._last_end.get(key)
                self._last_end[key] = end

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens continuing the longest suffix seen before; [] when
        no suffix of at least min_n tokens occurred earlier."""
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
            start = self._previous_end.get(n)
            if start is not None:
                return self.tokens[start : start + max_tokens]
        return []
