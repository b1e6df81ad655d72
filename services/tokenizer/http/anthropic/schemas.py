"""Anthropic Messages API bodies (/v1/messages, /v1/messages/count_tokens) → the tier's
GenerateInput.

Pure: JSON in, plain data out, InvalidRequestError naming the parameter at fault out of a bad
body (`messages[0].content[1].type` for an image block). Every parameter a body may carry is
declared; one we do not know or do not implement is refused with 400 naming it, never
silently ignored. Accepted without effect, because they cannot change the answer:
`cache_control` (our prefix cache is automatic), `service_tier` (one tier), `metadata.user_id`
(logged), a thinking block sent back in an assistant message (Anthropic drops earlier turns'
thinking from the context too), a thinking block's `signature`.

The conversation becomes our chat messages:

    system (string or text blocks)       → a system message, first
    user text blocks                     → a user message
    user tool_result blocks              → one tool message each (tool_call_id = tool_use_id),
                                           in order; text blocks between them → user messages
    assistant text + tool_use blocks     → an assistant message with its tool calls
                                           (arguments = the input as JSON text)

A conversation ending with an assistant message is a prefill: the answer continues that
message's text (services/text/chat_continuation.py), as Anthropic's API does; the response
holds only what the model added. An empty final assistant message is no prefill (left out);
one with tool_use blocks is refused (a call cannot be continued).

Sampling follows Anthropic's ranges (temperature 0..1, top_p 0..1, top_k >= 0) and its
required max_tokens. `thinking` {"type": "enabled" | "adaptive"} shows the model's thinking
as thinking blocks on a server started with --reasoning-parser (`budget_tokens` is not
enforced; max_tokens bounds thinking and answer together; `display: "omitted"` leaves the
blocks out). Without one the server cannot tell thinking from answer, and answers with text
blocks only, as llama.cpp's server does.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from services.contracts.errors import InvalidRequestError
from services.text.chat_template import ChatMessage, MessageToolCall, TextPart
from services.tokenizer.http.common import validated_body
from services.tokenizer.tool_request import (
    FunctionTool,
    ToolChoiceMode,
    ToolRequest,
    check_tool_request,
)
from services.tokenizer.validation import MAX_MODEL_NAME_LEN, GenerateInput, SamplingInput

ModelName = Annotated[str, Field(max_length=MAX_MODEL_NAME_LEN)]

TOOL_RESULT_ERROR_PREFIX = "Error: "
"""Put before a tool_result's content when `is_error` is set: chat templates have no field
for it, and the model should still know that the call failed."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None
    """Accepted only absent or null: we have no documents to cite."""


class DirectCaller(_Body):
    type: Literal["direct"]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: DirectCaller | None = None
    """As our responses carry it (the model called): handed back with the block. Calls by
    Anthropic's server tools are refused, naming `caller.type`."""


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


def _block_tag(value: Any) -> str | None:
    """A block's tag as pydantic reports it in an error's location: the type and a space, so
    that it is never mistaken for a parameter's name (http_common.body_param)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"{kind} block" if isinstance(kind, str) else None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text block")]
    | Annotated[ToolUseBlock, Tag("tool_use block")]
    | Annotated[ToolResultBlock, Tag("tool_result block")]
    | Annotated[ThinkingBlock, Tag("thinking block")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking block")],
    Discriminator(_block_tag),
]


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Body):
    type: Literal["custom"] | None = None
    """Client tools only: Anthropic's server tools (web search, code execution...) have
    other types and are refused here, naming `tools[i].type`."""
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class Metadata(_Body):
    user_id: Annotated[str, Field(max_length=256)] | None = None
    """The caller's id for its end user: logged with the request, nothing else."""


class _Conversation(_Body):
    """What both endpoints take: the prompt and its tools."""

    model: ModelName
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None


class MessagesBody(_Conversation):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


class CountTokensBody(_Conversation):
    pass


def parse_messages(body: bytes) -> MessagesBody:
    return validated_body(MessagesBody, body)


def parse_count_tokens(body: bytes) -> CountTokensBody:
    return validated_body(CountTokensBody, body)


# ---- → GenerateInput --------------------------------------------------------------------


def messages_input(body: MessagesBody, request_id: str) -> GenerateInput:
    """The generation request."""
    messages = chat_messages(body)
    return GenerateInput(
        request_id=request_id,
        messages=messages,
        sampling=SamplingInput(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_new_tokens=body.max_tokens,
            stop=tuple(body.stop_sequences or ()),
        ),
        model=body.model,
        tool_request=tool_request(body),
        continue_final_message=is_prefill(messages),
    )


def count_tokens_input(body: CountTokensBody) -> GenerateInput:
    """The prompt alone, as /v1/messages would build it for the same conversation."""
    messages = chat_messages(body)
    return GenerateInput(
        messages=messages,
        model=body.model,
        tool_request=tool_request(body),
        continue_final_message=is_prefill(messages),
    )


def is_prefill(messages: tuple[ChatMessage, ...]) -> bool:
    """Whether the answer continues the conversation's last message (chat_messages has
    left out an empty final assistant message)."""
    return bool(messages) and messages[-1].role == "assistant"


def thinking_enabled(body: _Conversation, reasoning_parser: str | None) -> bool:
    """Whether the answer shows the model's thinking (as thinking blocks): asked for, not
    hidden (`display: omitted`), and the server can tell thinking from the answer (without a
    reasoning parser all of it is answer, as llama.cpp's server answers)."""
    if body.thinking is None or body.thinking.type == "disabled":
        return False
    return reasoning_parser is not None and body.thinking.display != "omitted"


def chat_messages(body: _Conversation) -> tuple[ChatMessage, ...]:
    messages: list[ChatMessage] = []
    if body.system:
        messages.append(ChatMessage("system", _text(body.system)))
    for index, message in enumerate(body.messages):
        if message.role == "user":
            messages += _user_messages(message, index)
        else:
            messages.append(_assistant_message(message, index))
    last = len(body.messages) - 1
    if body.messages[last].role == "assistant":
        final = messages[-1]
        if final.tool_calls:
            raise InvalidRequestError(
                f"messages[{last}].content",
                "a final assistant message is continued (a prefill): it cannot hold tool_use "
                "blocks; send their tool_result in a user message",
            )
        if not final.text.strip():
            messages.pop()  # nothing to continue: an ordinary answer
    return tuple(messages)


def _user_messages(message: MessageParam, index: int) -> list[ChatMessage]:
    """Text blocks → a user message; each tool_result → a tool message, in their order."""
    if isinstance(message.content, str):
        return [ChatMessage("user", message.content)]
    out: list[ChatMessage] = []
    texts: list[TextPart] = []
    for position, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(TextPart(block.text))
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append(ChatMessage("user", tuple(texts)))
                texts = []
            out.append(_tool_message(block))
        else:
            raise _misplaced(block.type, index, position, "user")
    if texts or not out:
        out.append(ChatMessage("user", tuple(texts)))
    return out


def _tool_message(block: ToolResultBlock) -> ChatMessage:
    parts: tuple[TextPart, ...] = ()
    if isinstance(block.content, str):
        parts = (TextPart(block.content),)
    elif block.content:
        parts = tuple(TextPart(text.text) for text in block.content)
    if block.is_error:
        parts = (TextPart(TOOL_RESULT_ERROR_PREFIX), *parts)
    content: str | tuple[TextPart, ...] = parts
    if len(parts) <= 1:
        content = parts[0].text if parts else ""
    return ChatMessage("tool", content, tool_call_id=block.tool_use_id)


def _assistant_message(message: MessageParam, index: int) -> ChatMessage:
    if isinstance(message.content, str):
        return ChatMessage("assistant", message.content)
    texts: list[TextPart] = []
    calls: list[MessageToolCall] = []
    for position, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(TextPart(block.text))
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(MessageToolCall(block.id, block.name, arguments))
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            raise _misplaced(block.type, index, position, "assistant")
    return ChatMessage("assistant", tuple(texts), tool_calls=tuple(calls))


def _misplaced(kind: str, index: int, position: int, role: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"messages[{index}].content[{position}].type",
        f"a {kind!r} block cannot be in a {role} message",
    )


def _text(content: str | list[TextBlock]) -> str | tuple[TextPart, ...]:
    if isinstance(content, str):
        return content
    return tuple(TextPart(block.text) for block in content)


_CHOICE_MODES = {
    "auto": ToolChoiceMode.AUTO,
    "any": ToolChoiceMode.REQUIRED,
    "tool": ToolChoiceMode.FUNCTION,
    "none": ToolChoiceMode.NONE,
}


def tool_request(body: _Conversation) -> ToolRequest | None:
    """The tools and the tool choice (None: the request has no tools and forces none)."""
    choice = body.tool_choice
    if choice is not None and (choice.type == "tool") != (choice.name is not None):
        raise InvalidRequestError(
            "tool_choice.name", "is required with type 'tool', and only with it"
        )
    if not body.tools and (choice is None or choice.type in ("auto", "none")):
        return None
    request = ToolRequest(
        tools=tuple(
            FunctionTool(
                tool.name, tool.description or "", tool.input_schema, strict=bool(tool.strict)
            )
            for tool in body.tools or ()
        ),
        choice=_CHOICE_MODES[choice.type] if choice is not None else ToolChoiceMode.AUTO,
        function_name=(choice.name or "") if choice is not None else "",
        parallel_calls=not (choice is not None and choice.disable_parallel_tool_use),
    )
    check_tool_request(request, "tools", "tool_choice")
    return request
