"""Prefix fetch hints (pure logic; docs/prefix-cache.md, Prefix fetch): when routing sends a
request to a scheduler that holds less of its prompt's prefix than another one does (the holder
is overloaded, lacks the request's adapter, or the policy ignores the cache), the request names
the holder, and the chosen scheduler may fetch those blocks' KV from it instead of computing
them (it decides, from what fetching and computing have cost it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixSource:
    address: str
    """The scheduler holding the prefix (host:port)."""
    num_blocks: int
    """Leading full blocks of the prompt it holds, by the prefix index."""


def choose_prefix_source(
    cached: Sequence[int], addresses: Sequence[str], chosen: int, min_blocks: int
) -> PrefixSource | None:
    """The scheduler holding the most leading blocks, when that is at least `min_blocks` more
    than the chosen one holds (the first such in order on a tie); None otherwise, and always
    for `min_blocks` 0 (fetching off)."""
    if min_blocks <= 0:
        return None
    best = max(range(len(cached)), key=lambda i: (cached[i], -i), default=None)
    if best is None or best == chosen or cached[best] - cached[chosen] < min_blocks:
        return None
    return PrefixSource(addresses[best], cached[best])
