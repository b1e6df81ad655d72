"""Render chat messages to a prompt with the model's Jinja chat template, as Hugging Face
transformers' `apply_chat_template` does: the same sandboxed Jinja environment (trim and
lstrip blocks, loop controls, the `{% generation %}` tag), the same helpers (`raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML) and the same variables (`messages`,
`tools`, `documents`, `add_generation_prompt`, the named special tokens, extra keyword
variables such as `enable_thinking`), so a template renders here as the model's authors
tested it."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from services.contracts.errors import InvalidRequestError, ModelLoadError, quoted, shortened

ALLOWED_ROLES = ("system", "user", "assistant", "tool")

RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
"""Variables the renderer sets itself; `chat_template_kwargs` may set any other."""

NO_CHAT_TEMPLATE = (
    "this model has no chat template, so it cannot take chat messages: send a plain text "
    "prompt (completions work), or start the server with --chat-template NAME (a built-in "
    "such as chatml, llama3, mistral, gemma, phi3) or --chat-template FILE"
)


@dataclass(frozen=True, slots=True)
class TextPart:
    """One text part of a message's content, as OpenAI sends it ({"type": "text", ...})."""

    text: str


@dataclass(frozen=True, slots=True)
class MessageToolCall:
    """A call an assistant message made, as the conversation's history carries it."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's `function.arguments`)."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str | tuple[TextPart, ...]
    """A string, or text parts. The template sees either as it was sent (parts as a list of
    {"type": "text", "text": ...}), as transformers passes it: templates that iterate over a
    message's parts get them, templates written for strings only fail or render the list as
    they would under transformers."""
    tool_calls: tuple[MessageToolCall, ...] = ()
    """An assistant message's calls."""
    tool_call_id: str = ""
    """A tool message: the call it answers."""

    @property
    def text(self) -> str:
        """All of the content's text."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _RaisedByTemplate(TemplateError):
    """The template refused the conversation (its `raise_exception(...)`)."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _to_json(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML and sorts keys; templates are written
    # against transformers' filter, which does neither and takes json.dumps' arguments.
    item_and_key = tuple(separators) if separators is not None else None
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=item_and_key,  # type: ignore[arg-type]
        sort_keys=sort_keys,
    )


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the type
    itself (whose attributes lead to the interpreter's internals)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


class _TemplateNamespace(Namespace):
    """Jinja's `namespace()`, refusing underscore names as transformers does."""

    # Namespace's own signature trick: `namespace(self=...)` stays a plain attribute.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _check_namespace_name(name)
        Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a template may not store {name!r} on a namespace")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering a prompt keeps its body as is."""

    tags = {"generation"}  # noqa: RUF012 - Extension's own attribute

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    environment.filters["tojson"] = _to_json
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


_ENVIRONMENT = _environment()


class ChatTemplate:
    """One model's chat template (and its `tool_use` variant, if it has one), compiled."""

    def __init__(
        self,
        source: str,
        *,
        tool_use_source: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        clock: Callable[[], datetime] = datetime.now,
    ) -> None:
        """`special_tokens`: the variables named after the tokenizer's special tokens
        (bos_token, eos_token, unk_token, pad_token ...), those it has; `clock` gives
        `strftime_now` its time. A template that does not compile raises TemplateSyntaxError."""
        self.source = source
        self.tool_use_source = tool_use_source
        self.special_tokens = dict(special_tokens or {})
        template_globals = {"strftime_now": lambda format: clock().strftime(format)}
        self._template = _ENVIRONMENT.from_string(source, globals=template_globals)
        self._tool_use_template = (
            _ENVIRONMENT.from_string(tool_use_source, globals=template_globals)
            if tool_use_source is not None
            else None
        )
        self.reads_tools = tool_use_source is not None or reads_variable(source, "tools")
        """Whether the template shows the model its tools; when it does not, they go into
        the system message as text (tools_as_system_text), as llama.cpp's generic format
        does, and the answer's call syntax is plain JSON."""
        self.reads_content_parts = reads_content_parts(source)
        """Whether the template loops over a message's content (takes OpenAI's parts);
        otherwise text parts reach it joined into one string, as vLLM's 'auto' content format
        does: most templates (Llama 3.x, Qwen2.5/3, Phi, Mistral) only print the content."""

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text. `tools` (JSON schemas of functions, as OpenAI sends them) reach
        the template as `tools`, rendered by the `tool_use` template when the model has one;
        `chat_template_kwargs` become variables too (`enable_thinking=False`). Both are plain
        JSON data. A conversation the template refuses or fails on raises
        InvalidRequestError naming `messages`."""
        _check_messages(messages)
        extra = dict(chat_template_kwargs or {})
        for name in RESERVED_VARIABLES:
            if name in extra:
                raise InvalidRequestError(
                    "chat_template_kwargs", f"must not set {name!r}: the request gives it"
                )
        template = self._template
        if tools is not None and self._tool_use_template is not None:
            template = self._tool_use_template
        if tools and not self.reads_tools:
            messages, tools = tools_as_system_text(messages, tools), None
        variables = {
            **self.special_tokens,
            **extra,
            "messages": [
                _template_message(message, self.reads_content_parts) for message in messages
            ],
            "tools": [dict(tool) for tool in tools] if tools is not None else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        # A template's own error message may quote a message's content: keep it short.
        try:
            return template.render(variables)
        except _RaisedByTemplate as exc:
            raise InvalidRequestError("messages", shortened(str(exc), 200)) from exc
        except Exception as exc:
            # A template is a program: beyond Jinja's own errors it fails the way Python
            # does (a string added to a list, a missing key), and only on some
            # conversations. That is the request's problem, not the server's.
            reason = shortened(f"{type(exc).__name__}: {exc}", 200)
            raise InvalidRequestError("messages", f"the chat template failed: {reason}") from exc


def read_chat_template_file(path: str) -> str:
    """The template a --chat-template file holds, checked to compile (ModelLoadError
    otherwise, naming the file and the line)."""
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"chat template file {path}: {exc}") from exc
    try:
        _ENVIRONMENT.parse(source)
    except TemplateSyntaxError as exc:
        raise ModelLoadError(f"chat template file {path}, line {exc.lineno}: {exc}") from exc
    return source


def _check_messages(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise InvalidRequestError("messages", "must not be empty")
    for index, message in enumerate(messages):
        if message.role not in ALLOWED_ROLES:
            raise InvalidRequestError(
                f"messages[{index}].role",
                f"unknown role {quoted(message.role)} (allowed: {', '.join(ALLOWED_ROLES)})",
            )


TOOLS_SYSTEM_TEXT = (
    "You can call these functions, given as JSON Schemas:\n{tools}\n"
    "To call one, answer with only a JSON object: "
    '{{"name": <the function\'s name>, "arguments": <its arguments as an object>}}.'
)


def tools_as_system_text(
    messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]]
) -> list[ChatMessage]:
    """The tools described in the system message (added first when there is none), for a
    template that has no place for them."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    text = TOOLS_SYSTEM_TEXT.format(tools=listing)
    if messages and messages[0].role == "system":
        first = messages[0]
        return [replace(first, content=f"{first.text}\n\n{text}"), *messages[1:]]
    return [ChatMessage("system", text), *messages]


def reads_variable(source: str, name: str) -> bool:
    """Whether the template reads the variable `name` anywhere."""
    tree = _ENVIRONMENT.parse(source)
    return any(node.name == name for node in tree.find_all(nodes.Name) if node.ctx == "load")


def reads_content_parts(source: str) -> bool:
    """True when the template iterates over a `content` value (`{% for part in
    message['content'] %}` or `message.content`), the sign that it understands a list of
    parts; found in the parsed template, not its text."""
    tree = _ENVIRONMENT.parse(source)
    for loop in tree.find_all(nodes.For):
        kinds = (nodes.Getitem, nodes.Getattr, nodes.Name)
        lookups = [loop.iter, *loop.iter.find_all(kinds)]
        if any(_looked_up_key(node) == "content" for node in lookups):
            return True
    return False


def _looked_up_key(node: nodes.Node) -> Any:
    if isinstance(node, nodes.Name):  # a macro's or a set variable named content
        return node.name
    if isinstance(node, nodes.Getattr):
        return node.attr
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value
    return None


def _template_message(message: ChatMessage, parts_as_list: bool) -> dict[str, Any]:
    """A message as the template takes it: parts as a list of dicts (as transformers hands
    them) when the template loops over them, else their text joined."""
    rendered: dict[str, Any]
    if isinstance(message.content, str) or not parts_as_list:
        rendered = {"role": message.role, "content": message.text}
    else:
        parts = [{"type": "text", "text": part.text} for part in message.content]
        rendered = {"role": message.role, "content": parts}
    if message.tool_calls:
        rendered["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _template_tool_call(call: MessageToolCall) -> dict[str, Any]:
    """OpenAI's shape, with the arguments as an object when they are JSON: templates print
    them with `tojson` (Qwen, Llama 3.1, Mistral) and would quote the text a second time, so
    vLLM and transformers' own examples hand them an object."""
    try:
        arguments: Any = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = call.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }
