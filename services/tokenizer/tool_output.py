"""One choice's answer read for tool calls: text deltas in, (content, call pieces) out.

Which reader depends on the request's tool choice (tool_request.py):

    auto      the model family's parser (tool_calls.ToolCallStream): its call syntax becomes
              calls, the rest stays content.
    function  the answer is the named function's arguments (its grammar made it so): the call
              starts at once with its id and name, and the text streams as argument fragments.
    required  the answer is a JSON list of {"name", "arguments"} (its grammar made it so):
              forced_calls.RequiredCallsReader reads it as it streams, each call's arguments
              in pieces as they arrive.
    none      no reader: the answer is content.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.text.forced_calls import RequiredCallsReader
from services.text.tool_call_parsers import (
    CallArguments,
    CallStarted,
    ContentText,
    ToolCallDelta,
    ToolCallStream,
    ToolEvent,
    new_call_id,
)
from services.tokenizer.tool_request import ToolChoiceMode, ToolRequest


@dataclass(frozen=True, slots=True)
class ToolStep:
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


class ToolCallOutput:
    """Feed a choice's answer text; `made_calls` says whether it finishes with "tool_calls"."""

    def __init__(
        self, request: ToolRequest, parser: str, make_id: Callable[[], str] = new_call_id
    ) -> None:
        self._named = request.function_name if request.choice is ToolChoiceMode.FUNCTION else ""
        self._started = False
        self._stream: ToolCallStream | RequiredCallsReader | None = None
        if request.choice is ToolChoiceMode.REQUIRED:
            # A JSON list whatever the family (its grammar), read as it streams.
            self._stream = RequiredCallsReader(make_id)
        elif not self._named:
            self._stream = ToolCallStream(parser, make_id)
        self._make_id = make_id
        self.made_calls = False

    def feed(self, text: str) -> ToolStep:
        if self._stream is None:
            return self._named_call(text)
        return self._step(self._stream.feed(text))

    def finish(self) -> ToolStep:
        if not isinstance(self._stream, ToolCallStream):
            return ToolStep()
        return self._step(self._stream.finish())

    def _named_call(self, text: str) -> ToolStep:
        if self._started:
            return ToolStep(calls=(ToolCallDelta(0, arguments=text),) if text else ())
        self._started = self.made_calls = True
        return ToolStep(calls=(ToolCallDelta(0, self._make_id(), self._named, text),))

    def _step(self, events: list[ToolEvent]) -> ToolStep:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for event in events:
            if isinstance(event, ContentText):
                content.append(event.text)
            elif isinstance(event, CallStarted):
                self.made_calls = True
                calls.append(ToolCallDelta(event.index, event.id, event.name))
            elif isinstance(event, CallArguments):
                last = calls[-1] if calls else None
                if last is not None and last.index == event.index and not last.arguments:
                    # A call that arrives whole goes out as one piece: id, name, arguments.
                    calls[-1] = ToolCallDelta(last.index, last.id, last.name, event.fragment)
                else:
                    calls.append(ToolCallDelta(event.index, arguments=event.fragment))
        return ToolStep("".join(content), tuple(calls))
