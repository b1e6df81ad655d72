"""OpenAI response bodies and stream chunks from the pipeline's OutputDeltas. Pure: dicts
in OpenAI's shapes, and the server-sent-event framing of a stream.

A stream is: chunks with text (chat: the first one also carries the role), the last with its
finish_reason, then, when stream_options.include_usage is set, one chunk with usage and no
choices, then `data: [DONE]`. With include_usage every other chunk carries "usage": null, as
OpenAI's do.

With n > 1 each chunk carries one choice, named by its `index`; the choices' chunks interleave,
each choice ends with its own finish_reason, and the usage (the prompt counted once) comes
after the last. A whole response lists the n choices in index order.

Completions of a batch of prompts number the choices prompt-major (`prompts`: choice i is of
prompt i // n). With `echo` each choice's text starts with its prompt (in a stream: the
choice's first chunk), and its logprobs with an entry per prompt token whose logprob is null:
the scheduler reports logprobs of sampled tokens only (OpenAI's own first prompt token is null
the same way).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.contracts.usage import Usage
from services.text.tool_call_parsers import ToolCallDelta
from services.tokenizer.output import OutputDelta, TokenLogprob

TokenText = Callable[[int], str]
"""A token id's text, as the logprobs of a response spell it."""

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event holding `payload` as compact JSON (JSON never holds a raw
    newline, so one `data:` line always suffices)."""
    return b"data: " + json_bytes(payload) + b"\n\n"


def json_bytes(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def model_list(
    name: str,
    created: int,
    lora_adapters: Sequence[str] = (),
    owned_by: str = "llmserve",
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The served model, then its LoRA adapters, each with the served model as `parent`
    (as vLLM lists them, with the context length as `max_model_len`)."""
    return {
        "object": "list",
        "data": [
            {
                "id": model_id,
                "object": "model",
                "created": created,
                "owned_by": owned_by,
                "parent": parent,
                "max_model_len": max_model_len,
            }
            for model_id, parent in [(name, None), *((a, name) for a in lora_adapters)]
        ],
    }


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_piece(piece: ToolCallDelta) -> dict[str, Any]:
    """A stream's call piece: the first one of a call has its id, type and name, as
    OpenAI's do; the later ones only argument text."""
    if piece.id:
        return {"index": piece.index, **_call(piece.id, piece.name, piece.arguments)}
    return {"index": piece.index, "function": {"arguments": piece.arguments}}


@dataclass(slots=True)
class _Accumulated:
    """What a non-streaming response collects over the deltas."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    calls: dict[int, tuple[str, str, list[str]]] = field(default_factory=dict)
    """Per call index: its id, name and argument fragments."""

    def add(self, delta: OutputDelta) -> None:
        self.text.append(delta.text)
        self.reasoning.append(delta.reasoning_text)
        for piece in delta.tool_calls:
            _, _, arguments = self.calls.setdefault(piece.index, (piece.id, piece.name, []))
            arguments.append(piece.arguments)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason

    def whole_calls(self) -> list[tuple[str, str, str]]:
        """(id, name, arguments) per call in order. A call the token limit cut (finish
        "length", arguments that are not yet JSON) is left out: a response never holds a call
        that cannot be made (a stream has sent its pieces already; its "length" says so)."""
        calls = [
            (call_id, name, "".join(arguments))
            for call_id, name, arguments in (self.calls[i] for i in sorted(self.calls))
        ]
        if self.finish_reason != "length":
            return calls
        return [call for call in calls if _is_json(call[2])]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    """One prompt of a completions request, as its choices show it."""

    token_ids: tuple[int, ...]
    echo: str | None = None
    """The text each of its choices starts with (`echo: true`); None: no echo."""


@dataclass(slots=True)
class ResponseBuilder:
    """The bodies of one request, for either endpoint.

    chat: /v1/chat/completions shapes (else /v1/completions). top_logprobs: alternatives
    shown per token; None = no logprobs in the response at all. return_token_ids: each
    choice also carries the generated token ids (vLLM's extension).
    """

    chat: bool
    request_id: str
    model: str
    token_text: TokenText
    top_logprobs: int | None = None
    include_usage: bool = False
    return_token_ids: bool = False
    prompt_token_ids: tuple[int, ...] = ()
    """Sent with return_token_ids (as vLLM): top-level for chat, per choice for completions,
    in a stream's first chunk (per choice)."""
    n: int = 1
    """Choices per prompt."""
    prompts: tuple[CompletionPrompt, ...] = ()
    """Completions: the request's prompts (a batch: several); empty = one, whose ids are
    `prompt_token_ids`, without echo."""
    created: int = field(default_factory=lambda: int(time.time()))
    # Per choice index: whether its role went out, its text offset (completions logprobs),
    # what a whole response collects.
    _sent_role: set[int] = field(default_factory=set)
    _sent_prompt: set[int] = field(default_factory=set)
    _sent_echo: set[int] = field(default_factory=set)
    _text_offset: dict[int, int] = field(default_factory=dict)
    _collected: dict[int, _Accumulated] = field(default_factory=dict)
    _usage: Usage | None = None

    @property
    def num_choices(self) -> int:
        return self.n * max(1, len(self.prompts))

    def _prompt(self, index: int) -> CompletionPrompt:
        """Choice `index`'s prompt."""
        if not self.prompts:
            return CompletionPrompt(self.prompt_token_ids)
        return self.prompts[index // self.n]

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # ---- streaming ----

    def chunks(self, delta: OutputDelta) -> list[dict[str, Any]]:
        """The chunks one delta becomes (none when it carries nothing to say)."""
        echo = self._echo_once(delta.index)
        logprobs = self._logprobs(delta.logprobs, delta.index, echo)
        ids = self.return_token_ids and delta.token_ids
        said = delta.text or delta.reasoning_text or delta.tool_calls or delta.finish_reason
        if not (said or logprobs or ids or echo):
            return []
        choice: dict[str, Any] = {"index": delta.index}
        if self.chat:
            message: dict[str, Any] = {}
            if delta.index not in self._sent_role:
                message["role"] = "assistant"
                self._sent_role.add(delta.index)
            if delta.reasoning_text:
                # vLLM's and DeepSeek's field for a reasoning model's thinking.
                message["reasoning_content"] = delta.reasoning_text
            if delta.text or not (delta.finish_reason or delta.reasoning_text or delta.tool_calls):
                message["content"] = delta.text
            if delta.tool_calls:
                message["tool_calls"] = [_call_piece(piece) for piece in delta.tool_calls]
            choice["delta"] = message
        else:
            choice["text"] = ((echo.echo or "") if echo is not None else "") + delta.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = delta.finish_reason or None
        if self.return_token_ids:
            choice["token_ids"] = list(delta.token_ids)
            if not self.chat and delta.index not in self._sent_prompt:
                choice["prompt_token_ids"] = list(self._prompt(delta.index).token_ids)
                self._sent_prompt.add(delta.index)
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = [choice]
        if self.include_usage:
            chunk["usage"] = None
        chunks = [chunk]
        if self.include_usage and delta.usage is not None:
            last = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
            last["choices"] = []
            last["usage"] = usage_body(delta.usage)
            chunks.append(last)
        return chunks

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the role alone, before any token, as OpenAI's do: a client
        sees the response start at once. One chunk per choice, each with its own role (as
        OpenAI and vLLM send them with n > 1)."""
        self._sent_role.update(range(self.n))
        chunks = []
        for index in range(self.n):
            chunk = self._envelope("chat.completion.chunk")
            chunk["choices"] = [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
            if self.include_usage:
                chunk["usage"] = None
            if self.return_token_ids and index == 0:
                chunk["prompt_token_ids"] = list(self.prompt_token_ids)
            chunks.append(chunk)
        return chunks

    def _echo_once(self, index: int) -> CompletionPrompt | None:
        """Choice `index`'s prompt when it is echoed and this is its first chunk."""
        prompt = None if self.chat else self._prompt(index)
        if prompt is None or prompt.echo is None or index in self._sent_echo:
            return None
        self._sent_echo.add(index)
        return prompt

    # ---- whole response ----

    def add(self, delta: OutputDelta) -> None:
        self._collected.setdefault(delta.index, _Accumulated()).add(delta)
        self._usage = delta.usage or self._usage

    def response(self) -> dict[str, Any]:
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._choice(index) for index in range(self.num_choices)]
        if self.return_token_ids and self.chat:
            body["prompt_token_ids"] = list(self.prompt_token_ids)
        if self._usage is not None:
            body["usage"] = usage_body(self._usage)
        return body

    def _choice(self, index: int) -> dict[str, Any]:
        collected = self._collected.get(index, _Accumulated())
        text = "".join(collected.text)
        choice: dict[str, Any] = {"index": index}
        echoed: CompletionPrompt | None = None
        if self.chat:
            calls = collected.whole_calls()
            # OpenAI's content is null in an answer that is only calls (or a forced call the
            # limit cut: its partial arguments are not content).
            content = text if text or not collected.calls else None
            # `refusal` is required (nullable) in OpenAI's schema; we never refuse in-band.
            choice["message"] = {"role": "assistant", "content": content, "refusal": None}
            reasoning = "".join(collected.reasoning)
            if reasoning:
                choice["message"]["reasoning_content"] = reasoning
            if calls:
                choice["message"]["tool_calls"] = [_call(*call) for call in calls]
        else:
            prompt = self._prompt(index)
            echoed = prompt if prompt.echo is not None else None
            choice["text"] = (prompt.echo or "") + text
        self._text_offset[index] = 0
        choice["logprobs"] = self._logprobs(tuple(collected.logprobs), index, echoed)
        choice["finish_reason"] = collected.finish_reason or None
        if self.return_token_ids:
            choice["token_ids"] = collected.token_ids
            if not self.chat:
                choice["prompt_token_ids"] = list(self._prompt(index).token_ids)
        return choice

    # ---- logprobs ----

    def _logprobs(
        self,
        items: Sequence[TokenLogprob],
        index: int = 0,
        echoed: CompletionPrompt | None = None,
    ) -> dict[str, Any] | None:
        """`echoed`: the prompt whose tokens come first (completions), with null logprobs."""
        prompt_ids = echoed.token_ids if echoed is not None else ()
        if self.top_logprobs is None or not (items or prompt_ids):
            return None
        if self.chat:
            return {"content": [self._chat_logprob(item) for item in items], "refusal": None}
        tokens = [self.token_text(token_id) for token_id in prompt_ids]
        tokens += [self.token_text(item.token_id) for item in items]
        offsets = []
        offset = self._text_offset.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offset[index] = offset
        nulls: list[None] = [None] * len(prompt_ids)
        return {
            "tokens": tokens,
            "token_logprobs": [*nulls, *(item.logprob for item in items)],
            "top_logprobs": [*nulls, *(self._top_with_sampled(item) for item in items)],
            "text_offset": offsets,
        }

    def _top_with_sampled(self, item: TokenLogprob) -> dict[str, float]:
        """A completions entry: the top alternatives plus the sampled token, as vLLM's (so
        logprobs: 0 gives the sampled token's entry rather than an empty object)."""
        top = {self.token_text(token_id): logprob for token_id, logprob in self._top(item)}
        top.setdefault(self.token_text(item.token_id), item.logprob)
        return top

    def _top(self, item: TokenLogprob) -> list[tuple[int, float]]:
        assert self.top_logprobs is not None
        pairs = zip(item.top_token_ids, item.top_logprobs, strict=False)
        return list(pairs)[: self.top_logprobs]

    def _chat_logprob(self, item: TokenLogprob) -> dict[str, Any]:
        token = self.token_text(item.token_id)
        return {
            "token": token,
            "logprob": item.logprob,
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {
                    "token": (text := self.token_text(token_id)),
                    "logprob": logprob,
                    "bytes": list(text.encode("utf-8")),
                }
                for token_id, logprob in self._top(item)
            ],
        }
