"""Draft tokens by suffix decoding: continue a sequence the way text served before continued
after the same suffix, drawing on every recent prompt and output of the worker (model-free, as
SuffixDecoding / Arctic Inference and vLLM's suffix decoding), not only the sequence's own.

Pure Python. Every stored sequence is indexed by its k-grams (k = MIN_MATCH); a proposal

    1. looks up where the sequence's last k tokens occurred (the most recent MAX_CANDIDATES),
    2. extends each occurrence's match backwards, up to MAX_MATCH tokens, and keeps the
       occurrences of the longest matched suffix,
    3. walks forward from them, each step taking the most frequent next token among the
       occurrences still on the path, and stops where the path's empirical probability
       (the product of each step's count / occurrences) falls below `min_prob`.

That is the best path of a suffix tree over the stored text (the most frequent continuation
of the longest matched suffix) without holding the tree: a Python tree costs a node per token
per depth, this index one entry per token.

Scopes keep tenants apart: a sequence is stored and looked up under its scope (cache salt,
LoRA adapter), and one scope's text never drafts another's tokens. Memory is bounded by a
token budget over all scopes; the oldest sequences (by when they were first stored) go first.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

MIN_MATCH = 2
"""Shortest suffix matched (the index's k-gram length)."""
MAX_MATCH = 16
"""Longest suffix compared: a longer match says little more about what follows."""
MAX_CANDIDATES = 32
"""Most recent occurrences of a k-gram considered per proposal: bounds a step's Python time
for common k-grams (a newline pair may occur thousands of times)."""
SPEC_FACTOR = 2
"""A draft is at most SPEC_FACTOR x the matched length (a 2-token match guesses 4 at most)."""

Scope = Hashable
"""Where a sequence's text may be drafted from: (cache salt, LoRA adapter name)."""


@dataclass(slots=True)
class _Stored:
    request_id: str
    scope: Scope
    tokens: list[int]


@dataclass(slots=True)
class _ScopeIndex:
    # k-gram -> {stored key -> end positions (exclusive) of its occurrences}, both dicts in
    # insertion order, so "most recent" is the end of the iteration.
    occurrences: dict[tuple[int, ...], dict[int, list[int]]] = field(default_factory=dict)


class SuffixCache:
    """Recent sequences' tokens, by scope, within `max_tokens`."""

    def __init__(self, max_tokens: int, min_prob: float = 0.1) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        self.max_tokens = max_tokens
        self.min_prob = min_prob
        self.num_tokens = 0
        """Tokens stored over every scope (<= max_tokens)."""
        self._stored: dict[int, _Stored] = {}
        """Insertion ordered: the first entry is the oldest, evicted first."""
        self._keys: dict[str, int] = {}
        """request id -> its stored key (ids may be reused later; keys never are)."""
        self._next_key = 0
        self._scopes: dict[Scope, _ScopeIndex] = {}

    def __len__(self) -> int:
        return len(self._stored)

    def add(self, request_id: str, scope: Scope, tokens: Sequence[int]) -> None:
        """Store a sequence seen for the first time (its prompt, and any output of a resumed
        one). A request id already stored with these tokens as a continuation of what it holds
        (a preempted sequence back) is extended instead of stored twice."""
        key = self._keys.get(request_id)
        if key is not None:
            stored = self._stored[key]
            held = len(stored.tokens)
            if stored.scope == scope and list(tokens[:held]) == stored.tokens:
                self.extend(request_id, tokens[held:])
                return
            self._evict(key)
        if len(tokens) > self.max_tokens:
            return  # alone over the budget: not stored
        key = self._next_key
        self._next_key += 1
        self._keys[request_id] = key
        self._stored[key] = _Stored(request_id, scope, [])
        self.extend(request_id, tokens)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Append a stored sequence's new tokens (a no-op for one not stored, or evicted)."""
        key = self._keys.get(request_id)
        if key is None or not tokens:
            return
        stored = self._stored[key]
        index = self._scopes.setdefault(stored.scope, _ScopeIndex()).occurrences
        own = stored.tokens
        for token in tokens:
            own.append(token)
            end = len(own)
            if end >= MIN_MATCH:
                index.setdefault(tuple(own[end - MIN_MATCH :]), {}).setdefault(key, []).append(end)
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens and self._stored:
            self._evict(next(iter(self._stored)))

    def propose(self, scope: Scope, context: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` drafts continuing `context` (the sequence's tokens so far) by the
        scope's most frequent continuation of its longest matched suffix; [] when no suffix
        of MIN_MATCH tokens occurred or no continuation is likely enough."""
        scope_index = self._scopes.get(scope)
        if max_tokens <= 0 or scope_index is None or len(context) < MIN_MATCH:
            return []
        found = scope_index.occurrences.get(tuple(context[-MIN_MATCH:]))
        if not found:
            return []
        longest = min(MAX_MATCH, len(context))
        tail = list(context[-longest:])
        best_len = 0
        paths: list[tuple[list[int], int]] = []  # (tokens, start of the continuation)
        for key, ends in _most_recent(found, MAX_CANDIDATES):
            tokens = self._stored[key].tokens
            for end in ends:
                if end >= len(tokens):
                    continue  # the sequence's own end: nothing follows yet
                matched = _match_length(tokens, end, tail)
                if matched > best_len:
                    best_len, paths = matched, [(tokens, end)]
                elif matched == best_len:
                    paths.append((tokens, end))
        return self._best_path(paths, min(max_tokens, SPEC_FACTOR * best_len))

    def _best_path(self, paths: list[tuple[list[int], int]], max_tokens: int) -> list[int]:
        draft: list[int] = []
        probability = 1.0
        while paths and len(draft) < max_tokens:
            offset = len(draft)
            counts: dict[int, int] = {}
            for tokens, start in paths:
                if start + offset < len(tokens):
                    token = tokens[start + offset]
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            total = sum(counts.values())
            token, count = max(counts.items(), key=lambda item: item[1])
            probability *= count / total
            if probability < self.min_prob:
                break
            draft.append(token)
            paths = [
                (tokens, start)
                for tokens, start in paths
                if start + offset < len(tokens) and tokens[start + offset] == token
            ]
        return draft

    def _evict(self, key: int) -> None:
        stored = self._stored.pop(key)
        scope_index = self._scopes.setdefault(stored.scope, _ScopeIndex())
        tokens = stored.tokens
        for end in range(MIN_MATCH, len(tokens) + 1):
            gram = tuple(tokens[end - MIN_MATCH : end])
            holders = scope_index.occurrences.get(gram)
            if holders is not None and holders.pop(key, None) is not None and not holders:
                del scope_index.occurrences[gram]
        if not scope_index.occurrences:
            del self._scopes[stored.scope]
        self.num_tokens -= len(tokens)
        if self._keys.get(stored.request_id) == key:
            del self._keys[stored.request_id]

    def check_integrity(self) -> None:
        """The budget holds and the counts agree with what is stored (tests)."""
        assert self.num_tokens == sum(len(s.tokens) for s in self._stored.values())
        assert self.num_tokens <= self.max_tokens
        for scope, scope_index in self._scopes.items():
            for gram, holders in scope_index.occurrences.items():
                for key, ends in holders.items():
                    stored = self._stored[key]
                    assert stored.scope == scope
                    for end in ends:
                        assert tuple(stored.tokens[end - MIN_MATCH : end]) == gram


def _most_recent(found: dict[int, list[int]], limit: int) -> list[tuple[int, list[int]]]:
    """The last `limit` occurrences, grouped by stored key, newest first (so a tie between
    continuations goes to the most recent text)."""
    picked: list[tuple[int, list[int]]] = []
    for key in reversed(found):
        ends = found[key][-limit:][::-1]
        picked.append((key, ends))
        limit -= len(ends)
        if limit <= 0:
            break
    return picked


def _match_length(tokens: list[int], end: int, tail: list[int]) -> int:
    """How many of `tail`'s last tokens end at tokens[end] (at least MIN_MATCH: the k-gram
    matched), compared longest first with list slices."""
    for length in range(min(len(tail), end), MIN_MATCH, -1):
        if tokens[end - length : end] == tail[len(tail) - length :]:
            return length
    return MIN_MATCH
