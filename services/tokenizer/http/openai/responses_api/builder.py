"""The Open Responses `response` object and its stream events, from the pipeline's deltas.

Pure. Output items open as their first piece arrives, in the order the model says them:
a reasoning item, a message (one output_text part), then function calls; the next kind of
piece closes the open item. Every event carries the stream's next sequence_number.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.contracts.usage import Usage
from services.tokenizer.output import OutputDelta


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass(slots=True)
class _Item:
    """One output item as it grows: its body, and its text or arguments so far."""

    body: dict[str, Any]
    text: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return str(self.body["type"])


@dataclass(slots=True)
class ResponseObject:
    """One response: `echo` holds the request fields the object repeats (model, tools...)."""

    response_id: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    sequence_number: int = 0
    items: list[_Item] = field(default_factory=list)
    _open: _Item | None = None
    _calls: dict[int, _Item] = field(default_factory=dict)
    finish_reason: str = ""
    usage: Usage | None = None

    # ---- the object ----

    def body(self, status: str) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            **self.echo,
            "output": [item.body for item in self.items],
            "usage": usage_body(self.usage),
        }

    @property
    def final_status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    # ---- events ----

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.body("in_progress")),
            self.event("response.in_progress", response=self.body("in_progress")),
        ]

    def add(self, delta: OutputDelta) -> None:
        """A whole answer's delta (http_common.collect's sink)."""
        self.events(delta)

    def events(self, delta: OutputDelta) -> list[dict[str, Any]]:
        """The events one delta makes (its pieces also grow the object)."""
        events: list[dict[str, Any]] = []
        if delta.reasoning_text:
            events += self._grow("reasoning", delta.reasoning_text)
        if delta.text:
            events += self._grow("message", delta.text)
        for piece in delta.tool_calls:
            call = self._calls.get(piece.index)
            if call is None:
                events += self._close()
                call = self._calls[piece.index] = self._open_item(
                    {
                        "type": "function_call",
                        "id": new_id("fc"),
                        "call_id": piece.id,
                        "name": piece.name,
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
                events.append(self._added(call))
            if piece.arguments:
                call.text.append(piece.arguments)
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=call.body["id"],
                        output_index=self.items.index(call),
                        delta=piece.arguments,
                    )
                )
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.usage = delta.usage or self.usage
        if delta.ends_stream:
            if not self.items:
                # An answer that ended at once (the end token first) is still one message:
                # clients read output[0], and the spec's object has a non-empty output.
                events += self._grow("message", "")
            events += self._close()
        return events

    def finish(self) -> dict[str, Any]:
        status = self.final_status
        return self.event(f"response.{status}", response=self.body(status))

    def _grow(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item.kind != kind:
            events += self._close()
            item = self._open_item(_empty(kind))
            events.append(self._added(item))
            if kind == "message":
                events.append(self._part("response.content_part.added", item, ""))
        if not text:
            return events
        item.text.append(text)
        index = self.items.index(item)
        if kind == "message":
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=item.body["id"],
                    output_index=index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        else:
            events.append(
                self.event(
                    "response.reasoning.delta",
                    item_id=item.body["id"],
                    output_index=index,
                    content_index=0,
                    delta=text,
                )
            )
        return events

    def _open_item(self, body: dict[str, Any]) -> _Item:
        item = _Item(body)
        self.items.append(item)
        self._open = item
        return item

    def _added(self, item: _Item) -> dict[str, Any]:
        return self.event(
            "response.output_item.added",
            output_index=self.items.index(item),
            item=_copy(item.body),
        )

    def _part(self, kind: str, item: _Item, text: str) -> dict[str, Any]:
        return self.event(
            kind,
            item_id=item.body["id"],
            output_index=self.items.index(item),
            content_index=0,
            part=_output_text(text),
        )

    def _close(self) -> list[dict[str, Any]]:
        """Close the open item: its done events, its body final."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        text = "".join(item.text)
        events: list[dict[str, Any]] = []
        # The item open when max_output_tokens ended the answer was cut: a call's arguments may
        # not be whole JSON, so it ends `incomplete` (a client runs only completed calls).
        item.body["status"] = self.final_status
        if item.kind == "message":
            item.body["content"] = [_output_text(text)]
            events.append(
                self.event(
                    "response.output_text.done",
                    item_id=item.body["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            events.append(self._part("response.content_part.done", item, text))
        elif item.kind == "reasoning":
            item.body["content"] = [{"type": "reasoning_text", "text": text}]
            del item.body["status"]
            events.append(
                self.event(
                    "response.reasoning.done",
                    item_id=item.body["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            )
        else:
            item.body["arguments"] = text
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item.body["id"],
                    output_index=index,
                    name=item.body["name"],
                    arguments=text,
                )
            )
        events.append(
            self.event("response.output_item.done", output_index=index, item=_copy(item.body))
        )
        return events


def _empty(kind: str) -> dict[str, Any]:
    if kind == "message":
        return {
            "type": "message",
            "id": new_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
    return {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress"}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(body: dict[str, Any]) -> dict[str, Any]:
    return {key: (list(value) if isinstance(value, list) else value) for key, value in body.items()}
