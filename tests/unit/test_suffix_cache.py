"""Suffix decoding's cache: the most frequent continuation of the longest matched suffix, cut
where its probability falls under the threshold; scopes (tenant salt, adapter) never draft each
other's tokens; the token budget evicts the oldest sequences; a brute-force search agrees on
random sequences; and a hypothesis state machine keeps the counts consistent."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.worker.speculative.suffix_cache import MAX_MATCH, MIN_MATCH, SPEC_FACTOR, SuffixCache

A = (b"", "")


def test_drafts_from_another_sequence_of_the_scope() -> None:
    cache = SuffixCache(1000)
    cache.add("old", A, [1, 2, 3, 4, 5, 6, 7, 8])
    cache.add("new", A, [9, 9, 2, 3])
    assert cache.propose(A, [9, 9, 2, 3], 3) == [4, 5, 6]


def test_follows_the_most_frequent_continuation() -> None:
    cache = SuffixCache(1000)
    for index, tail in enumerate(([7, 7], [7, 7], [8, 8])):
        cache.add(f"r{index}", A, [1, 2, 3, *tail])
    assert cache.propose(A, [5, 2, 3], 4) == [7, 7]


def test_the_longest_matched_suffix_decides() -> None:
    cache = SuffixCache(1000)
    cache.add("a", A, [1, 2, 3, 40, 41])
    cache.add("b", A, [9, 2, 3, 50, 51])
    cache.add("c", A, [8, 2, 3, 50, 51])
    # Two occurrences continue with 50, but only "a" matches the context's last three tokens.
    assert cache.propose(A, [0, 1, 2, 3], 2) == [40, 41]


def test_cut_where_the_probability_falls_below_the_threshold() -> None:
    cache = SuffixCache(1000, min_prob=0.5)
    cache.add("a", A, [1, 2, 3, 4, 5, 10])
    cache.add("b", A, [1, 2, 3, 4, 5, 11])
    cache.add("c", A, [1, 2, 3, 4, 5, 12])
    # 4, 5 are certain; the next token is one of three (1/3 < 0.5): cut there.
    assert cache.propose(A, [1, 2, 3], 6) == [4, 5]
    assert SuffixCache(1000, min_prob=0.0).propose(A, [1, 2, 3], 0) == []


def test_draft_length_is_bounded_by_the_match() -> None:
    cache = SuffixCache(1000)
    cache.add("a", A, list(range(40)))
    assert cache.propose(A, [0, 1], 16) == list(range(2, 2 + SPEC_FACTOR * 2))
    assert cache.propose(A, list(range(10)), 16) == list(range(10, 26))


def test_scopes_never_draft_each_others_tokens() -> None:
    cache = SuffixCache(1000)
    tenant_a, tenant_b, adapter = (b"a", ""), (b"b", ""), (b"a", "sql")
    cache.add("a", tenant_a, [1, 2, 3, 4, 5])
    assert cache.propose(tenant_a, [1, 2, 3], 2) == [4, 5]
    assert cache.propose(tenant_b, [1, 2, 3], 2) == []
    assert cache.propose(adapter, [1, 2, 3], 2) == []
    cache.add("b", tenant_b, [1, 2, 3, 6, 7])
    assert cache.propose(tenant_b, [1, 2, 3], 2) == [6, 7]
    assert cache.propose(tenant_a, [1, 2, 3], 2) == [4, 5]


def test_the_budget_evicts_the_oldest_sequences() -> None:
    cache = SuffixCache(10)
    cache.add("a", A, [1, 2, 3, 4])
    cache.add("b", A, [5, 6, 7, 8])
    cache.extend("a", [9, 9])  # "a" grows; it is still the oldest
    assert cache.num_tokens == 10
    cache.add("c", A, [10, 11])
    assert cache.num_tokens == 6 and len(cache) == 2
    assert cache.propose(A, [1, 2], 2) == []
    assert cache.propose(A, [5, 6], 2) == [7, 8]
    cache.extend("a", [1, 2])  # evicted: ignored
    assert cache.propose(A, [1, 2], 2) == []
    cache.add("huge", A, list(range(11)))  # alone over the budget: not stored
    assert cache.num_tokens == 6
    cache.check_integrity()


def test_a_resumed_sequence_is_extended_not_stored_twice() -> None:
    cache = SuffixCache(100)
    cache.add("a", A, [1, 2, 3])
    cache.add("a", A, [1, 2, 3, 4, 5])
    assert cache.num_tokens == 5
    cache.add("a", A, [7, 7])  # the id reused for other tokens: the old ones go
    assert cache.num_tokens == 2
    cache.check_integrity()


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixCache(-1)
    with pytest.raises(ValueError, match="min_prob"):
        SuffixCache(10, min_prob=1.5)


def brute_force(stored: list[list[int]], context: list[int], k: int, min_prob: float) -> list[int]:
    """The best path of a suffix tree over `stored` (every occurrence, no candidate cap; ties
    to the most recent occurrence)."""
    tail = context[-MAX_MATCH:]
    best, paths = 0, []
    for tokens in reversed(stored):
        for end in reversed(range(MIN_MATCH, len(tokens))):
            n = 0
            while n < min(len(tail), end) and tokens[end - n - 1] == tail[len(tail) - n - 1]:
                n += 1
            if n < MIN_MATCH:
                continue
            if n > best:
                best, paths = n, [(tokens, end)]
            elif n == best:
                paths.append((tokens, end))
    draft: list[int] = []
    probability = 1.0
    while paths and len(draft) < min(k, SPEC_FACTOR * best):
        nexts = [t[s + len(draft)] for t, s in paths if s + len(draft) < len(t)]
        if not nexts:
            break
        counts = {token: nexts.count(token) for token in dict.fromkeys(nexts)}
        token = max(counts, key=lambda t: counts[t])
        probability *= counts[token] / len(nexts)
        if probability < min_prob:
            break
        paths = [(t, s) for t, s in paths if s + len(draft) < len(t) and t[s + len(draft)] == token]
        draft.append(token)
    return draft


def test_agrees_with_a_brute_force_suffix_tree() -> None:
    rng = random.Random(5)
    for _ in range(200):
        stored = [[rng.randrange(4) for _ in range(rng.randrange(2, 12))] for _ in range(3)]
        cache = SuffixCache(1000, min_prob=0.3)
        for index, tokens in enumerate(stored):
            cache.add(str(index), A, tokens)
        context = [rng.randrange(4) for _ in range(rng.randrange(2, 6))]
        assert cache.propose(A, context, 5) == brute_force(stored, context, 5, 0.3), (
            stored,
            context,
        )


class SuffixCacheMachine(RuleBasedStateMachine):
    """Adds, extensions and evictions in any order keep the budget and the index exact, and a
    draft always comes from the asking scope's text."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = SuffixCache(40)

    @rule(
        request=st.sampled_from("abcdef"),
        scope=st.sampled_from([(b"x", ""), (b"y", ""), (b"x", "lora")]),
        tokens=st.lists(st.integers(0, 5), max_size=12),
    )
    def add(self, request: str, scope: tuple[bytes, str], tokens: list[int]) -> None:
        self.cache.add(request, scope, tokens)

    @rule(request=st.sampled_from("abcdef"), tokens=st.lists(st.integers(0, 5), max_size=6))
    def extend(self, request: str, tokens: list[int]) -> None:
        self.cache.extend(request, tokens)

    @rule(
        scope=st.sampled_from([(b"x", ""), (b"y", ""), (b"x", "lora")]),
        context=st.lists(st.integers(0, 5), min_size=2, max_size=8),
    )
    def propose(self, scope: tuple[bytes, str], context: list[int]) -> None:
        draft = self.cache.propose(scope, context, 8)
        scope_texts = [s.tokens for s in self.cache._stored.values() if s.scope == scope]
        if draft:
            assert any(_contains(t, draft) for t in scope_texts)

    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity()


def _contains(tokens: list[int], part: list[int]) -> bool:
    return any(tokens[i : i + len(part)] == part for i in range(len(tokens) - len(part) + 1))


SuffixCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30)
test_suffix_cache_state_machine = SuffixCacheMachine.TestCase


def test_bad_config_values_name_the_flag() -> None:
    from services.worker.config import WorkerConfig

    with pytest.raises(ValueError, match="speculative_suffix_cache_tokens"):
        WorkerConfig(speculative_suffix_cache_tokens=-5)
    with pytest.raises(ValueError, match="speculative_suffix_min_prob"):
        WorkerConfig(speculative_suffix_min_prob=2.0)
    assert WorkerConfig(speculative_suffix_cache_tokens=1024).speculative_suffix_cache_tokens
