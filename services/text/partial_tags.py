"""Holding back a tag cut across text deltas (`<think>`...): a client must see a
tag whole or not at all."""

from __future__ import annotations


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (0: none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
