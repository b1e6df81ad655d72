"""Reasoning kept apart from the answer: a model that thinks inside `<think>...</think>` (DeepSeek
R1, Qwen3) has that text returned as `reasoning_content`, the rest as `content`.

A pure, incremental splitter: text deltas in (as the detokenizer produces them), pairs of
(reasoning, content) deltas out. A tag split across deltas is held back until it is whole or
proven not to be a tag, so no client ever sees half a `</think>`.

Parsers, named as vLLM names them (`--reasoning-parser`):
  deepseek_r1  the reasoning may start without `<think>` (R1's template opens the tag in the
               prompt): everything before `</think>` is reasoning.
  qwen3        reasoning only inside an explicit `<think>...</think>`; without one the whole
               output is the answer (thinking switched off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from services.contracts.text_parsers import ReasoningParserName
from services.text.partial_tags import partial_tag_suffix

THINK_START = "<think>"
THINK_END = "</think>"
PARSERS: tuple[str, ...] = get_args(ReasoningParserName)


@dataclass(frozen=True, slots=True)
class SplitDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """One choice's output, split as it streams. `feed` each text delta, `finish` at the end."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")
        # Without an opening `<think>`, deepseek_r1's output is reasoning (the template opened
        # the tag in the prompt), qwen3's is the answer.
        self._untagged = "reasoning" if parser == "deepseek_r1" else "content"
        self._state = "start"
        self._held = ""  # text that may be the start of a tag

    @property
    def in_reasoning(self) -> bool:
        """True while the output is still reasoning (a grammar waits for the answer)."""
        return self._state in ("reasoning", "start")

    def feed(self, text: str) -> SplitDelta:
        reasoning: list[str] = []
        content: list[str] = []
        pending = self._held + text
        self._held = ""
        while pending:
            if self._state == "start":
                stripped = pending.lstrip()
                if THINK_START.startswith(stripped) and len(stripped) < len(THINK_START):
                    self._held = pending  # maybe `<think>`: wait for more
                    break
                if stripped.startswith(THINK_START):
                    pending = stripped[len(THINK_START) :]
                    self._state = "reasoning"
                else:
                    self._state = self._untagged
                continue
            if self._state == "reasoning":
                end = pending.find(THINK_END)
                if end >= 0:
                    reasoning.append(pending[:end])
                    pending = pending[end + len(THINK_END) :]
                    self._state = "after_end"
                    continue
                keep = partial_tag_suffix(pending, THINK_END)
                reasoning.append(pending[: len(pending) - keep])
                self._held = pending[len(pending) - keep :]
                break
            if self._state == "after_end":
                # The newlines a template puts between the thinking and the answer belong to
                # neither, however the deltas cut them.
                pending = pending.lstrip("\n")
                if pending:
                    self._state = "content"
                continue
            content.append(pending)
            break
        return SplitDelta("".join(reasoning), "".join(content))

    def finish(self) -> SplitDelta:
        """The output ended: whatever was held back is what it looked like."""
        held, self._held = self._held, ""
        if not held:
            return SplitDelta()
        if self._state == "reasoning" or (self._state == "start" and self._untagged == "reasoning"):
            return SplitDelta(reasoning=held)
        return SplitDelta(content=held)


def split_reasoning(parser: str, text: str) -> SplitDelta:
    """A whole output at once: (reasoning, answer)."""
    splitter = ReasoningSplitter(parser)
    first, last = splitter.feed(text), splitter.finish()
    return SplitDelta(first.reasoning + last.reasoning, first.content + last.content)


def prompt_closes_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt itself ends the thinking (Qwen3's template with thinking off
    writes an empty `<think>\n\n</think>`): the answer starts at the first token."""
    end = prompt_tail.rfind(THINK_END)
    return end >= 0 and end > prompt_tail.rfind(THINK_START)
