"""Tool calls out of a model's text, in its family's format, named as vLLM names the parsers
(`--tool-call-parser`):

  hermes       Hermes, Qwen2.5/Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
               any number, text around them is the answer's content.
  llama3_json  Llama 3.x: the whole output is `{"name": ..., "parameters": {...}}` (optionally
               after `<|python_tag|>`), several separated by `;`.
  mistral      Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects.
  json         generic: the whole output is one such object, or a list of them.

A pure, incremental parser: text deltas in, events out (content text, a call's start with its
id and name, its arguments). A call's arguments go out whole once its JSON is complete, right
after its start; text that only looks like a call (bad JSON, no name) goes out as content, as
vLLM does, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.text.partial_tags import partial_tag_suffix

PARSERS = ("hermes", "llama3_json", "mistral", "json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_START = "[TOOL_CALLS]"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments as JSON text (what OpenAI's `function.arguments` carries)."""


@dataclass(frozen=True, slots=True)
class ContentText:
    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    fragment: str


ToolEvent = ContentText | CallStarted | CallArguments


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One piece of a streamed call, as OpenAI streams them: the first piece of a call has
    its id and name, later ones (or the first too) a fragment of its arguments' JSON text;
    the fragments of one `index` joined are the call's arguments."""

    index: int
    """The call's place among the choice's calls."""
    id: str = ""
    name: str = ""
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One choice's output, parsed as it streams. `feed` each text delta, `finish` at the end."""

    def __init__(self, parser: str, make_id: Callable[[], str] = new_call_id) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(PARSERS)}")
        self.parser = parser
        self.make_id = make_id
        self.calls: list[ToolCall] = []
        self._text = ""  # hermes: not yet decided; the others: everything so far
        self._in_call = False
        self._whole_output: bool | None = None  # the others: is the output a call at all?

    def feed(self, text: str) -> list[ToolEvent]:
        if self.parser == "hermes":
            return self._feed_hermes(text)
        self._text += text
        if self._whole_output is None:
            head = self._text.lstrip()
            starts = _call_openings(self.parser)
            if any(s.startswith(head) for s in starts) and not any(
                head.startswith(s) for s in starts
            ):
                return []  # too short to tell
            self._whole_output = any(head.startswith(s) for s in starts)
        if self._whole_output:
            return []  # a call's JSON is parsed whole at the end
        out, self._text = self._text, ""
        return [ContentText(out)] if out else []

    def finish(self) -> list[ToolEvent]:
        if self.parser == "hermes":
            held, self._text = self._text, ""
            if self._in_call:
                return [ContentText(HERMES_START + held)]  # never closed: not a call
            return [ContentText(held)] if held else []
        text, self._text = self._text, ""
        if not self._whole_output:
            return [ContentText(text)] if text else []
        objects = _whole_output_calls(self.parser, text)
        if objects is None:
            return [ContentText(text)]
        events: list[ToolEvent] = []
        for obj in objects:
            events.extend(self._call(obj))
        return events

    def _feed_hermes(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        pending = self._text + text
        self._text = ""
        while pending:
            if self._in_call:
                end = pending.find(HERMES_END)
                if end < 0:
                    self._text = pending
                    break
                body, pending = pending[:end], pending[end + len(HERMES_END) :]
                self._in_call = False
                obj = _json_object(body)
                if obj is None or _call_name(obj) is None:
                    events.append(ContentText(HERMES_START + body + HERMES_END))
                else:
                    events.extend(self._call(obj))
                continue
            start = pending.find(HERMES_START)
            if start >= 0:
                if start:
                    events.append(ContentText(pending[:start]))
                pending = pending[start + len(HERMES_START) :]
                self._in_call = True
                continue
            keep = partial_tag_suffix(pending, HERMES_START)
            if len(pending) > keep:
                events.append(ContentText(pending[: len(pending) - keep]))
            self._text = pending[len(pending) - keep :]
            break
        return events

    def _call(self, obj: dict[str, Any]) -> list[ToolEvent]:
        name = _call_name(obj)
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if name is None:
            return [ContentText(json.dumps(obj, ensure_ascii=False))]
        text = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        call = ToolCall(self.make_id(), name, text)
        index = len(self.calls)
        self.calls.append(call)
        return [CallStarted(index, call.id, name), CallArguments(index, text)]


def parser_for_template(template: str) -> str:
    """The parser for the call syntax a chat template teaches its model (`auto`): the tag it
    writes calls in, else the generic JSON one."""
    if HERMES_START in template:
        return "hermes"
    if MISTRAL_START in template:
        return "mistral"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "json"


def parse_tool_calls(
    parser: str, text: str, make_id: Callable[[], str] = new_call_id
) -> tuple[str, list[ToolCall]]:
    """A whole output at once: (content, calls)."""
    stream = ToolCallStream(parser, make_id)
    events = stream.feed(text) + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentText))
    return content, stream.calls


def _call_openings(parser: str) -> tuple[str, ...]:
    if parser == "mistral":
        return (MISTRAL_START,)
    if parser == "llama3_json":
        return ("{", PYTHON_TAG)
    return ("{", "[")


def _whole_output_calls(parser: str, text: str) -> list[dict[str, Any]] | None:
    """The call objects a whole output holds, or None when it is not (only) calls."""
    body = text.strip()
    if parser == "mistral":
        body = body[len(MISTRAL_START) :].strip()
    elif parser == "llama3_json" and body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if parser == "llama3_json":
        parts = [_json_object(part) for part in _split_top_level(body, ";")]
        objects = [p for p in parts if p is not None]
        if len(objects) != len(parts):
            return None
    else:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        objects = value if isinstance(value, list) else [value]
    if not objects or not all(isinstance(o, dict) and _call_name(o) for o in objects):
        return None
    return objects


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _call_name(obj: dict[str, Any]) -> str | None:
    name = obj.get("name")
    return name if isinstance(name, str) and name else None


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` cut at `separator`s outside JSON strings and brackets."""
    parts: list[str] = []
    depth, in_string, escaped, start = 0, False, False, 0
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]
