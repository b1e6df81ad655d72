"""Prompt-lookup drafts: the longest suffix seen before is continued, from its most recent
earlier occurrence, and the index agrees with a brute-force search on random sequences."""

from __future__ import annotations

import random

import pytest

from services.worker.speculative.ngram_proposer import NgramIndex


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


def test_continues_a_copied_passage() -> None:
    passage = [11, 12, 13, 14, 15, 16, 17]
    index = NgramIndex(1, 3, [1, 2, *passage, 3, 4, 11, 12, 13])
    assert index.propose(3) == [14, 15, 16]
    index.extend([14, 15])
    assert index.propose(10) == [16, 17, 3, 4, 11, 12, 13, 14, 15]


def test_prefers_the_longest_suffix_then_the_latest_occurrence() -> None:
    # "2 3" continues with 9 the first time and 7 the second; "1 2 3" only with 9.
    index = NgramIndex(1, 3, [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3])
    assert index.propose(1) == [9]
    index = NgramIndex(1, 2, [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3])
    assert index.propose(1) == [7]


def test_nothing_to_propose() -> None:
    assert NgramIndex(1, 3, []).propose(4) == []
    assert NgramIndex(1, 3, [1, 2, 3, 4]).propose(4) == []
    assert NgramIndex(2, 3, [5, 1, 5]).propose(4) == []  # only a 1-gram repeats
    assert NgramIndex(1, 3, [5, 1, 5]).propose(0) == []


def test_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        NgramIndex(0, 3)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force_as_tokens_arrive(seed: int) -> None:
    rng = random.Random(seed)
    min_n, max_n, k = rng.randint(1, 2), rng.randint(2, 4), rng.randint(1, 6)
    index = NgramIndex(min_n, max_n)
    tokens: list[int] = []
    for _ in range(300):
        # A small alphabet, so n-grams repeat often.
        chunk = [rng.randint(0, 5) for _ in range(rng.randint(1, 3))]
        index.extend(chunk)
        tokens.extend(chunk)
        assert index.propose(k) == brute_force(tokens, min_n, max_n, k)
