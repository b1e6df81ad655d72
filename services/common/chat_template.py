"""Render chat messages to a prompt with the model's Jinja chat template (as HF does)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.errors import InvalidRequestError, quoted, shortened

ALLOWED_ROLES = ("system", "user", "assistant", "tool")

# Used when a model ships no template: ChatML, which most small instruct models speak.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        # trim_blocks/lstrip_blocks match how transformers renders templates.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self.source = source or DEFAULT_CHAT_TEMPLATE
        self._template = env.from_string(self.source)
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> str:
        if not messages:
            raise InvalidRequestError("messages", "must not be empty")
        for index, message in enumerate(messages):
            if message.role not in ALLOWED_ROLES:
                raise InvalidRequestError(
                    f"messages[{index}].role",
                    f"unknown role {quoted(message.role)} (allowed: {', '.join(ALLOWED_ROLES)})",
                )
        payload: list[dict[str, Any]] = [{"role": m.role, "content": m.content} for m in messages]
        # A template's own error message may quote a message's content: keep it short.
        try:
            return self._template.render(
                messages=payload,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except _TemplateRaised as exc:
            raise InvalidRequestError("messages", shortened(str(exc), 200)) from exc
        except TemplateError as exc:
            reason = shortened(str(exc), 200)
            raise InvalidRequestError("messages", f"chat template failed: {reason}") from exc
