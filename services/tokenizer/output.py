"""One request's output: the scheduler's token events in, the public response deltas out.

Pure (no gRPC, no protobuf, no clock reads: times are passed in). Per scheduler event:

    token ids → incremental detokenize → stop strings → OutputDelta
    last event (or a stop string) → finish_reason, usage, timings

A request with n > 1 choices has a detokenizer and a stop-string matcher per choice: each
event and delta names its choice (`index`), each choice finishes on its own, and the delta
that finishes the last one also carries the usage (the prompt counted once, the completion
tokens of every choice summed) and the timings.

Several scheduler events that waited for a slow client go through as one (scheduler_convert.py
merges them): one detokenizer call and one public message for all their ids, with the same text and
ids as one event at a time, cut at the token that completes a stop string.

routing/scheduler_convert.py maps SubmitResponse → SchedulerOutput, convert.py OutputDelta →
GenerateResponse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.contracts.usage import Usage
from services.text.detokenizer import IncrementalDetokenizer
from services.text.reasoning import ReasoningSplitter
from services.text.stop_strings import StopStringMatcher
from services.text.tool_call_parsers import ToolCallDelta
from services.tokenizer.tool_output import ToolCallOutput
from services.tokenizer.tool_request import ToolRequest

# The finish reasons that end a stream normally, as the public API names them: the
# scheduler's three, and "tool_calls" for a choice whose answer made a call (this pipeline's).
PUBLIC_FINISH_REASONS = frozenset({"stop", "length", "abort", "tool_calls"})


# ---- data in and out ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One message of the scheduler's Submit stream (zero fields: not reported in it)."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str = ""
    queue_ms: float = 0.0
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    index: int = 0
    """The choice (n > 1) the message belongs to."""


@dataclass(frozen=True, slots=True)
class Timings:
    queue_ms: float
    ttft_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class OutputDelta:
    """One public message of one choice: new text and ids; the choice's last one also its
    finish_reason, and the stream's last one (every choice finished) usage and timings."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str = ""
    usage: Usage | None = None
    timings: Timings | None = None
    index: int = 0
    reasoning_text: str = ""
    """With a reasoning parser: the new reasoning (`text` is then the answer only)."""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    """With tools: pieces of the calls the answer makes (`text` is then the rest of it); a
    choice that made a call finishes with "tool_calls"."""
    matched_stop: str = ""
    """With finish_reason "stop": the stop string that ended the choice (empty: the model's
    end of sequence or a stop token)."""

    @property
    def ends_stream(self) -> bool:
        """The last delta of the request: only it carries the usage."""
        return self.usage is not None


# ---- text out: whole characters, never a stop string --------------------------------------


@dataclass(frozen=True, slots=True)
class TextStep:
    text: str
    """Text that may be sent now."""
    stopped: bool = False
    """A stop string matched: the stream ends here and no later text may be sent."""
    num_token_ids: int = 0
    """How many of the added ids the step took: all of them, or when a stop string matched,
    those up to the one whose text completed it (the ids after it are never sent)."""
    stop: str = ""
    """The stop string that matched (stopped)."""


class OutputText:
    """One request's generated ids → text that is safe to send.

    The detokenizer holds back incomplete UTF-8 characters; the stop matcher then holds back
    any suffix that could still grow into a stop string, and drops the stop and what follows.

    Adding ids in chunks gives the same text and, at a stop, the same last id as adding
    them one at a time (what a client that keeps up sees).
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str]
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(stop) if stop else None

    def add(self, token_ids: Sequence[int]) -> TextStep:
        if self._stops is None or len(token_ids) <= 1:
            # Without stop strings every id is sent, and the detokenizer's text does not
            # depend on the chunking: one call for the whole chunk, two decodes in all
            # instead of two per id.
            step = self._match(self._detokenizer.add(token_ids))
            return replace(step, num_token_ids=len(token_ids))
        # Try the chunk at once on copies. That is exact when the detokenizer then holds
        # nothing back (its text is all the ids' text, as one at a time would have sent by
        # the last id) and no stop completes in it. Otherwise replay one id at a time on the
        # originals, which finds the id a stop completes at (rare: once per request, or on
        # an incomplete character at the chunk's end).
        detokenizer, stops = self._detokenizer.copy(), self._stops.copy()
        text = detokenizer.add(token_ids)
        if detokenizer.num_pending_tokens == 0:
            result = stops.feed(text)
            if not result.stopped:
                self._detokenizer, self._stops = detokenizer, stops
                return TextStep(result.text, num_token_ids=len(token_ids))
        parts: list[str] = []
        for index, token_id in enumerate(token_ids):
            step = self._match(self._detokenizer.add((token_id,)))
            parts.append(step.text)
            if step.stopped:
                return TextStep("".join(parts), True, index + 1, step.stop)
        return TextStep("".join(parts), num_token_ids=len(token_ids))

    def finish(self) -> TextStep:
        """The end of the stream: flush both hold-back buffers (a stop may still match)."""
        step = self._match(self._detokenizer.finish())
        if step.stopped or self._stops is None:
            return step
        return TextStep(step.text + self._stops.flush())

    def _match(self, delta: str) -> TextStep:
        if self._stops is None:
            return TextStep(delta)
        result = self._stops.feed(delta)
        return TextStep(result.text, result.stopped, stop=result.stop or "")


# ---- the whole pipeline -------------------------------------------------------------------


@dataclass(slots=True)
class Progress:
    """Counters of one Generate call, for usage, timings and logs (times in seconds of one
    monotonic clock, passed in)."""

    num_prompt_tokens: int
    started_s: float
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    queue_ms: float = 0.0
    ttft_ms: float | None = None

    def observe(self, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.queue_ms:
            self.queue_ms = scheduler_output.queue_ms
        if scheduler_output.num_cached_tokens:
            self.num_cached_tokens = scheduler_output.num_cached_tokens
        if scheduler_output.num_prompt_tokens:
            self.num_prompt_tokens = scheduler_output.num_prompt_tokens

    def elapsed_ms(self, now_s: float) -> float:
        return (now_s - self.started_s) * 1000.0

    def sending(self, num_token_ids: int, now_s: float) -> None:
        self.num_completion_tokens += num_token_ids
        if self.ttft_ms is None and num_token_ids:
            self.ttft_ms = self.elapsed_ms(now_s)


@dataclass(slots=True)
class OutputPipeline:
    """Scheduler events of one request → public deltas; one OutputText per choice."""

    texts: list[OutputText]
    progress: Progress
    finished: list[bool]
    """Per choice: its finish delta was made (later events of it are dropped)."""
    reasoning: list[ReasoningSplitter] | None = None
    """Per choice, with a reasoning parser: its text split into reasoning and answer."""
    tools: list[ToolCallOutput] | None = None
    """Per choice, with tools to call: its answer read for calls."""

    @property
    def num_unfinished(self) -> int:
        return self.finished.count(False)

    @classmethod
    def create(
        cls,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        started_s: float,
        n: int = 1,
        reasoning_parser: str | None = None,
        tool_request: ToolRequest | None = None,
        tool_call_parser: str = "json",
    ) -> OutputPipeline:
        """`tool_request`: the request's tools, read for with `tool_call_parser` (the model
        family's call syntax) unless its choice is none."""
        reads_calls = tool_request is not None and tool_request.parses_calls
        return cls(
            [OutputText(tokenizer, prompt_token_ids, stop) for _ in range(n)],
            Progress(len(prompt_token_ids), started_s),
            [False] * n,
            [ReasoningSplitter(reasoning_parser) for _ in range(n)] if reasoning_parser else None,
            [ToolCallOutput(tool_request, tool_call_parser) for _ in range(n)]
            if reads_calls and tool_request is not None
            else None,
        )

    def step(self, scheduler_output: SchedulerOutput, now_s: float) -> OutputDelta | None:
        """One scheduler message → the public message to send (None: nothing to send yet).

        A message may carry token ids with empty text (half a character, or text held back
        because it may begin a stop string). Messages of a choice that has finished (a stop
        string ended it while the scheduler went on) are dropped.
        """
        index = scheduler_output.index
        if not 0 <= index < len(self.texts) or self.finished[index]:
            return None
        progress = self.progress
        progress.observe(scheduler_output)
        output_text = self.texts[index]
        step = output_text.add(scheduler_output.token_ids)
        text = step.text
        token_ids = scheduler_output.token_ids[: step.num_token_ids]
        logprobs = scheduler_output.logprobs[: step.num_token_ids]
        finish_reason = "stop" if step.stopped else scheduler_output.finish_reason
        tail_stop = ""
        if finish_reason and not step.stopped:
            tail = output_text.finish()
            text += tail.text
            if tail.stopped:
                finish_reason, tail_stop = "stop", tail.stop
        progress.sending(len(token_ids), now_s)
        text, reasoning_text = self._split(index, text, finished=bool(finish_reason))
        text, calls, made_calls = self._read_calls(index, text, finished=bool(finish_reason))
        delta = OutputDelta(
            text,
            token_ids,
            logprobs,
            index=index,
            reasoning_text=reasoning_text,
            tool_calls=calls,
        )
        if not finish_reason:
            return delta if (text or reasoning_text or calls or token_ids) else None
        self.finished[index] = True
        if finish_reason == "stop" and made_calls:
            finish_reason = "tool_calls"
        delta = replace(delta, finish_reason=finish_reason, matched_stop=step.stop or tail_stop)
        if not all(self.finished):
            return delta
        total_ms = progress.elapsed_ms(now_s)
        return replace(
            delta,
            usage=Usage(
                prompt_tokens=progress.num_prompt_tokens,
                completion_tokens=progress.num_completion_tokens,
                cached_prompt_tokens=progress.num_cached_tokens,
            ),
            timings=Timings(
                queue_ms=progress.queue_ms,
                ttft_ms=progress.ttft_ms if progress.ttft_ms is not None else total_ms,
                total_ms=total_ms,
            ),
        )

    def _read_calls(
        self, index: int, text: str, finished: bool
    ) -> tuple[str, tuple[ToolCallDelta, ...], bool]:
        """(content, call pieces, whether the choice made a call) of its new answer text."""
        if self.tools is None:
            return text, (), False
        reader = self.tools[index]
        step = reader.feed(text)
        content, calls = step.content, step.calls
        if finished:
            last = reader.finish()
            content, calls = content + last.content, calls + last.calls
        return content, calls, reader.made_calls

    def _split(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """(answer, reasoning) of a choice's new text; all answer without a parser."""
        if self.reasoning is None:
            return text, ""
        splitter = self.reasoning[index]
        delta = splitter.feed(text)
        content, reasoning = delta.content, delta.reasoning
        if finished:
            last = splitter.finish()
            content, reasoning = content + last.content, reasoning + last.reasoning
        return content, reasoning
