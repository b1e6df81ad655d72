"""Stop strings over a stream of text deltas: cut the output where the first stop completes.

A stop string may arrive split over several deltas ("</" then "s>"), so the matcher holds
back the longest suffix of the text seen so far that could still grow into a stop string,
and emits it only once it cannot (or when the stream ends without a stop).

Matching runs an Aho-Corasick automaton over the stop strings, one character at a time:
its state is exactly that longest suffix, so a delta costs O(len(delta)) automaton steps
plus O(max stop length) string slicing, however long the output already is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_ROOT = 0


@dataclass(frozen=True, slots=True)
class StopResult:
    """What `feed()` decided: the text safe to emit now, and whether the stream stops here."""

    text: str
    stopped: bool = False
    stop: str | None = None  # the stop string that matched, when stopped


class _StopAutomaton:
    """Aho-Corasick over the stop strings; node = a prefix of some stop string."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self.children: list[dict[str, int]] = [{}]
        self.depth: list[int] = [0]
        # The longest stop string that is a suffix of the node's text: with several stops
        # ending at one position, the longest is the one that starts earliest.
        self.match: list[str | None] = [None]
        self.fail: list[int] = [_ROOT]
        for stop in stop_strings:
            node = _ROOT
            for char in stop:
                child = self.children[node].get(char)
                if child is None:
                    child = len(self.children)
                    self.children[node][char] = child
                    self.children.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.match.append(None)
                    self.fail.append(_ROOT)
                node = child
            self.match[node] = stop
        self._link_failures()

    def _link_failures(self) -> None:
        # Breadth-first, so a node's failure target (a shorter text) is final before it.
        queue = list(self.children[_ROOT].values())
        for node in queue:
            for char, child in self.children[node].items():
                target = self.fail[node]
                while target != _ROOT and char not in self.children[target]:
                    target = self.fail[target]
                # child is at least two deep, so this is a strictly shorter suffix.
                self.fail[child] = self.children[target].get(char, _ROOT)
                if self.match[child] is None:
                    self.match[child] = self.match[self.fail[child]]
                queue.append(child)

    def step(self, node: int, char: str) -> int:
        while node != _ROOT and char not in self.children[node]:
            node = self.fail[node]
        return self.children[node].get(char, _ROOT)


class StopStringMatcher:
    """Cuts one request's text stream at the first stop string; text after it is dropped.

    The first stop to *complete* wins (that is the moment a streaming reader would stop);
    of stops completing at the same character, the one starting earliest (the longest).
    With `include_stop_str_in_output` the stop string itself is emitted too (as in vLLM).
    """

    def __init__(
        self, stop_strings: Sequence[str], *, include_stop_str_in_output: bool = False
    ) -> None:
        if any(not stop for stop in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._automaton = _StopAutomaton(stop_strings)
        self._include_stop = include_stop_str_in_output
        self._node = _ROOT
        # Invariant: _held == the last depth[_node] characters seen, none of them emitted.
        self._held = ""
        self._stop: str | None = None

    def copy(self) -> StopStringMatcher:
        """An independent matcher in the same state (the automaton is shared: it never changes)."""
        clone = object.__new__(StopStringMatcher)
        clone.__dict__.update(self.__dict__)
        return clone

    @property
    def stopped(self) -> bool:
        return self._stop is not None

    @property
    def stop(self) -> str | None:
        """The stop string that ended the stream, if one did."""
        return self._stop

    @property
    def held_text(self) -> str:
        """Text seen but not yet emitted because a stop string may still complete from it."""
        return self._held

    def feed(self, delta: str) -> StopResult:
        """Takes the next text delta; returns what may be emitted, and whether to stop."""
        if self._stop is not None:
            return StopResult("", stopped=True, stop=self._stop)
        automaton = self._automaton
        node = self._node
        for index, char in enumerate(delta):
            node = automaton.step(node, char)
            stop = automaton.match[node]
            if stop is not None:
                text = self._held + delta[: index + 1]
                end = len(text) if self._include_stop else len(text) - len(stop)
                self._stop = stop
                self._node = _ROOT
                self._held = ""
                return StopResult(text[:end], stopped=True, stop=stop)
        self._node = node
        text = self._held + delta
        keep = automaton.depth[node]
        # The held suffix is never longer than the text: depth grows by one per character.
        self._held = text[len(text) - keep :]
        return StopResult(text[: len(text) - keep])

    def flush(self) -> str:
        """Releases the held-back text when the stream ends without a stop."""
        text = "" if self._stop is not None else self._held
        self._held = ""
        self._node = _ROOT
        return text
