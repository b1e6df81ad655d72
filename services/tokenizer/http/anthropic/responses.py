"""Messages API responses from the pipeline's OutputDeltas. Pure: dicts in Anthropic's shapes,
and the server-sent-event framing of a stream.

A response is a list of content blocks, in the order the model wrote them:

    thinking   the model's reasoning (with --reasoning-parser, when the request enabled it)
    text       the answer
    tool_use   one per call: {id, name, input}; the id is ours with Anthropic's prefix
               (call_X → toolu_X), the same in both forms of a response

A stream is Anthropic's event sequence:

    message_start          the message with no content, usage.input_tokens
    content_block_start    per block, in order: the block empty (a tool_use with input {})
    content_block_delta*   text_delta / thinking_delta / input_json_delta (partial_json: the
                           fragments of the call's arguments as JSON text)
    content_block_stop
    message_delta          stop_reason, stop_sequence; usage (cumulative)
    message_stop

A whole response is the same blocks, collected by the same code: the two forms cannot differ.
Text that is only whitespace is held until more text comes and dropped if a block of another
kind or the end comes first (the newlines a model writes before a tool call are no block).

Usage is Anthropic's: `input_tokens` counts the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` those that were (their sum is the prompt); `output_tokens` all the
generated tokens, thinking and tool calls included.

Every object carries every key Anthropic's published schema requires, those we have nothing
for as null (a text block's `citations`, a message's `stop_details` and `container`, usage's
`server_tool_use`...): strict clients and validators read our answers as Anthropic's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from services.contracts.usage import Usage
from services.text.tool_call_parsers import ToolCallDelta
from services.tokenizer.http.openai.responses import json_bytes
from services.tokenizer.output import OutputDelta

BlockKind = Literal["text", "thinking", "tool_use"]
Event = tuple[str, dict[str, Any]]
"""An SSE event: its name and its data (the data's `type` is the name too)."""

OUR_CALL_PREFIX = "call_"
TOOL_USE_PREFIX = "toolu_"
DIRECT_CALLER = {"type": "direct"}
"""Who made a tool call: the model itself (Anthropic's other callers are its server tools)."""


def sse(event: Event) -> bytes:
    name, data = event
    return b"event: " + name.encode() + b"\ndata: " + json_bytes(data) + b"\n\n"


def tool_use_id(call_id: str) -> str:
    """Our call id as Anthropic spells its ids. A client hands it back in tool_result as is;
    the chat template only needs it to match the call's."""
    return TOOL_USE_PREFIX + call_id.removeprefix(OUR_CALL_PREFIX)


def usage_body(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    """A message's `usage` (Anthropic's Usage: every key present, the ones we have no use
    for null; nothing is written to a cache with a TTL, so its breakdown is zeros)."""
    return {
        **delta_usage_body(prompt_tokens, cached_tokens, output_tokens),
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "inference_geo": None,
        "service_tier": "standard",
    }


def delta_usage_body(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    """message_delta's `usage` (Anthropic's MessageDeltaUsage, cumulative)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
        "output_tokens_details": None,
        "server_tool_use": None,
    }


def stop_reason(
    finish_reason: str, matched_stop: str, usage: Usage | None, max_tokens: int, called: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for our finish reason."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        # Our "length" is also a full context, which Anthropic names apart.
        if usage is not None and usage.completion_tokens < max_tokens:
            return "model_context_window_exceeded", None
        return "max_tokens", None
    if finish_reason == "stop" and matched_stop:
        return "stop_sequence", matched_stop
    # "stop" at the end of sequence; "abort" (the client cancelled) never reaches one.
    return ("tool_use" if called else "end_turn"), None


@dataclass(slots=True)
class _Block:
    kind: BlockKind
    parts: list[str] = field(default_factory=list)
    """Its text, thinking, or fragments of its arguments' JSON text."""
    id: str = ""
    name: str = ""

    def start(self) -> dict[str, Any]:
        if self.kind == "text":
            return {"type": "text", "text": "", "citations": None}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        return {
            "type": "tool_use",
            "id": self.id,
            "name": self.name,
            "input": {},
            "caller": DIRECT_CALLER,
        }

    def delta(self, piece: str) -> dict[str, Any]:
        if self.kind == "text":
            return {"type": "text_delta", "text": piece}
        if self.kind == "thinking":
            return {"type": "thinking_delta", "thinking": piece}
        return {"type": "input_json_delta", "partial_json": piece}

    def whole(self) -> dict[str, Any]:
        text = "".join(self.parts)
        if self.kind == "text":
            return {"type": "text", "text": text, "citations": None}
        if self.kind == "thinking":
            # No signature: nothing here verifies a thinking block sent back (schemas.py
            # drops them), so there is nothing to sign.
            return {"type": "thinking", "thinking": text, "signature": ""}
        return {
            "type": "tool_use",
            "id": self.id,
            "name": self.name,
            "input": _input(text),
            "caller": DIRECT_CALLER,
        }


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is. The tool-call parser hands
    out only complete JSON objects, so anything else means no arguments."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(slots=True)
class MessageBuilder:
    """One request's response, whole or as its stream of events.

    Feed every delta to `events` (streaming: send what it returns) or `add` (whole: then
    `response()`). `max_tokens`: the request's, to tell a full context from it.
    `show_thinking`: the request enabled thinking (else reasoning text is left out).
    """

    message_id: str
    model: str
    max_tokens: int
    show_thinking: bool = False
    blocks: list[_Block] = field(default_factory=list)
    _open: int | None = None
    """The block being streamed (its index), None between blocks."""
    _call_blocks: dict[int, int] = field(default_factory=dict)
    """A tool call's index among the answer's calls → its block's index."""
    _held_space: str = ""
    _stop: tuple[str, str | None] | None = None
    _usage: dict[str, Any] | None = None

    # ---- streaming ----

    def message_start(self, prompt_tokens: int, cached_tokens: int) -> Event:
        message = self._envelope([])
        message["stop_reason"] = None
        message["stop_sequence"] = None
        message["usage"] = usage_body(prompt_tokens, cached_tokens, 0)
        return "message_start", {"type": "message_start", "message": message}

    def events(self, delta: OutputDelta) -> list[Event]:
        """The events one delta becomes; the last delta's end with message_stop."""
        events: list[Event] = []
        if delta.reasoning_text and self.show_thinking:
            events += self._append("thinking", delta.reasoning_text)
        if delta.text:
            events += self._text(delta.text)
        for piece in delta.tool_calls:
            events += self._tool_call(piece)
        if not delta.ends_stream:
            return events
        usage = delta.usage
        assert usage is not None  # ends_stream
        events += self._close()
        self._held_space = ""
        called = any(block.kind == "tool_use" for block in self.blocks)
        self._stop = stop_reason(
            delta.finish_reason, delta.matched_stop, usage, self.max_tokens, called
        )
        counts = (usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens)
        self._usage = usage_body(*counts)
        reason, sequence = self._stop
        delta_body = {
            "stop_reason": reason,
            "stop_sequence": sequence,
            "stop_details": None,
            "container": None,
        }
        events.append(
            (
                "message_delta",
                {"type": "message_delta", "delta": delta_body, "usage": delta_usage_body(*counts)},
            )
        )
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _text(self, text: str) -> list[Event]:
        if self._open is not None and self.blocks[self._open].kind == "text":
            return self._append("text", text)
        text = self._held_space + text
        if not text.strip():
            self._held_space = text
            return []
        self._held_space = ""
        return self._append("text", text)

    def _append(self, kind: BlockKind, piece: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self.blocks[self._open].kind != kind:
            events += self._start(_Block(kind))
        assert self._open is not None
        return events + self._piece(self._open, piece)

    def _tool_call(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        index = self._call_blocks.get(piece.index)
        if index is None:
            call_id = piece.id or f"{self.message_id}_{piece.index}"
            events += self._start(_Block("tool_use", id=tool_use_id(call_id), name=piece.name))
            assert self._open is not None
            index = self._call_blocks[piece.index] = self._open
        if piece.arguments:
            events += self._piece(index, piece.arguments)
        return events

    def _start(self, block: _Block) -> list[Event]:
        events = self._close()
        self._held_space = ""
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        start = {"type": "content_block_start", "index": self._open, "content_block": block.start()}
        return [*events, ("content_block_start", start)]

    def _piece(self, index: int, piece: str) -> list[Event]:
        block = self.blocks[index]
        block.parts.append(piece)
        data = {"type": "content_block_delta", "index": index, "delta": block.delta(piece)}
        return [("content_block_delta", data)]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    # ---- whole response ----

    def add(self, delta: OutputDelta) -> None:
        self.events(delta)

    def response(self) -> dict[str, Any]:
        body = self._envelope([block.whole() for block in self.blocks])
        reason, sequence = self._stop or ("end_turn", None)
        body["stop_reason"] = reason
        body["stop_sequence"] = sequence
        body["usage"] = self._usage or usage_body(0, 0, 0)
        return body

    def _envelope(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_details": None,
            "container": None,
        }
