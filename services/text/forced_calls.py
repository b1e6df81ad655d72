"""`tool_choice: "required"`'s answer read as it streams: a JSON list of {"name", "arguments"}
objects (its grammar made it so, tool_request.forced_call_grammar) → call events as the
characters arrive, so a forced call's arguments stream in pieces like a named function's.

    [ {"name": "get_weather", "arguments": {"city": "Paris"}} , {...} ]
      ^ a call object      ^ CallStarted once the name's string closes
                                          ^ CallArguments: the value's own characters, as
                                            written, in the pieces they arrive in

The arguments' pieces joined are the value's JSON text exactly as the model wrote it (what
a named function's call carries too). A call whose arguments come before its name (a
grammar that let the keys swap) has them held until the name closes. Text outside the list
(whitespace) is dropped: a forced answer has no content. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from services.text.tool_call_parsers import CallArguments, CallStarted, ToolEvent, new_call_id

_LIST_DEPTH = 1  # inside the outer list
_CALL_DEPTH = 2  # inside one call object


@dataclass(slots=True)
class _Call:
    """The call object being read."""

    key: list[str] = field(default_factory=list)
    """The raw characters of the current key (or of the name's value)."""
    reading: str = ""
    """What the characters are now: "key", "name", "arguments" or "" (between tokens)."""
    after_colon: str = ""
    """The key whose value comes next."""
    name: str = ""
    held_arguments: list[str] = field(default_factory=list)
    started: bool = False
    arguments_closed: bool = False


class RequiredCallsReader:
    """Feed the answer's text; each call starts with its id and name, then its arguments
    stream. `complete_calls` counts the calls whose object closed (a cut answer's last call
    did not)."""

    def __init__(self, make_id: Callable[[], str] = new_call_id) -> None:
        self._make_id = make_id
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._call: _Call | None = None
        self._value_depth = 0  # the depth the arguments' value opened at
        self.num_calls = 0
        self.complete_calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        for char in text:
            self._char(char, events)
        return _merged(events)

    def _char(self, char: str, events: list[ToolEvent]) -> None:
        call = self._call
        string_char = self._in_string
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        if call is None:
            if not string_char and char == "{" and self._depth == _LIST_DEPTH:
                self._call = _Call()
            self._depth += _nesting(char, string_char)
            return
        if call.reading == "arguments":
            self._arguments_char(call, char, string_char, events)
            return
        if call.reading in ("key", "name"):
            call.key.append(char)
            if not self._in_string:  # the string closed
                self._string_closed(call, events)
            return
        # Between tokens, at the call object's own depth.
        if string_char or self._in_string:
            call.reading = "name" if call.after_colon == "name" else "key"
            call.key = [char]
            return
        if char == ":":
            call.after_colon = "".join(call.key)
            call.key = []
            if call.after_colon == "arguments":
                call.reading = "arguments"
                self._value_depth = self._depth
            return
        if char == "}" and self._depth == _CALL_DEPTH:
            self._depth -= 1
            self._call = None
            if call.started and call.arguments_closed:
                self.complete_calls += 1
            return
        self._depth += _nesting(char, string_char)

    def _string_closed(self, call: _Call, events: list[ToolEvent]) -> None:
        text = "".join(call.key)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = ""
        if call.reading == "name":
            call.name = value if isinstance(value, str) else ""
            call.after_colon = ""
            self._start(call, events)
        else:
            call.key = [value] if isinstance(value, str) else []
        call.reading = ""

    def _start(self, call: _Call, events: list[ToolEvent]) -> None:
        if call.started or not call.name:
            return
        call.started = True
        index = self.num_calls
        self.num_calls += 1
        events.append(CallStarted(index, self._make_id(), call.name))
        if call.held_arguments:
            events.append(CallArguments(index, "".join(call.held_arguments)))
            call.held_arguments = []

    def _arguments_char(
        self, call: _Call, char: str, string_char: bool, events: list[ToolEvent]
    ) -> None:
        """One character of the arguments' value: sent, unless it ends the value (a `,` or
        `}` back at the call object's depth) or is whitespace around it."""
        structural = not string_char and not self._in_string
        if structural and self._depth == self._value_depth:
            if char in ",}":
                call.reading, call.after_colon, call.arguments_closed = "", "", True
                self._char(char, events)  # the call object's own `,` or `}`
                return
            if char.isspace():
                return
        if structural:
            self._depth += _nesting(char, string_char)
        if call.started:
            events.append(CallArguments(self.num_calls - 1, char))
        else:
            call.held_arguments.append(char)


def _nesting(char: str, in_string: bool) -> int:
    if in_string:
        return 0
    return 1 if char in "[{" else -1 if char in "]}" else 0


def _merged(events: list[ToolEvent]) -> list[ToolEvent]:
    """One CallArguments per run of characters of the same call."""
    out: list[ToolEvent] = []
    for event in events:
        last = out[-1] if out else None
        if (
            isinstance(event, CallArguments)
            and isinstance(last, CallArguments)
            and last.index == event.index
        ):
            out[-1] = CallArguments(event.index, last.fragment + event.fragment)
        else:
            out.append(event)
    return out
