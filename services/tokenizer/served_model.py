"""The model this tier serves: its tokenizer and the limits the edge checks, built from the
description a scheduler passes on from its worker (no model file, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.contracts.errors import ModelLoadError
from services.contracts.model_description import ModelDescription
from services.text.model_tokenizer import ModelTokenizer
from services.text.reasoning import THINK_END
from services.text.tool_call_parsers import parser_for_template
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.validation import Limits


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The tokenizer plus what the edge checks need to know about the model."""

    description: ModelDescription
    tokenizer: ModelTokenizer
    reasoning_parser: str | None = None
    """How chat answers' thinking is told from their content (--reasoning-parser)."""
    tool_call_parser: str = "json"
    """How the model writes a tool call (--tool-call-parser, auto resolved)."""

    @classmethod
    def from_description(
        cls,
        description: ModelDescription,
        *,
        chat_template: str | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str = "auto",
    ) -> ServedModel:
        """`chat_template` (--chat-template's) replaces the model's own templates;
        `tool_call_parser` auto is told from the template that renders tools."""
        if chat_template is not None:
            description = replace(
                description, chat_template=chat_template, tool_use_chat_template=None
            )
        if tool_call_parser == "auto":
            template = description.tool_use_chat_template or description.chat_template
            tool_call_parser = parser_for_template(template or "")
        return cls(
            description,
            ModelTokenizer.from_description(description),
            reasoning_parser,
            tool_call_parser,
        )

    @property
    def reasoning_end_ids(self) -> tuple[int, ...]:
        """The ids of the end-of-thinking tag, where a grammar starts (--reasoning-parser);
        a few characters to encode, once per request that has both."""
        return tuple(self.tokenizer.encode(THINK_END, add_special_tokens=False))

    @property
    def name(self) -> str:
        return self.description.model_name

    @property
    def max_model_len(self) -> int:
        return self.description.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.description.vocab_size

    def limits(self, config: TokenizerConfig) -> Limits:
        return Limits(
            model_name=self.name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_new_tokens_limit=config.max_new_tokens_limit or self.max_model_len,
            max_stop_strings=config.max_stop_strings,
            max_stop_string_len=config.max_stop_string_len,
            max_prompt_chars=self.max_prompt_chars,
        )

    @property
    def max_prompt_chars(self) -> int:
        """The most characters of text that can fit the context, whatever its tokens."""
        return self.max_model_len * self.tokenizer.max_chars_per_token


def one_model(answers: dict[str, ModelDescription]) -> ModelDescription:
    """The model every answering scheduler serves (by address); a replica serves one model.

    The context length may differ between workers (each its own --max-model-len): the
    smallest holds for all of them.
    """
    if not answers:
        raise ValueError("no scheduler described its model")
    first = next(iter(answers.values()))
    for address, description in answers.items():
        if replace(description, max_model_len=0) != replace(first, max_model_len=0):
            others = ", ".join(f"{a}: {d.model_name}" for a, d in answers.items())
            raise ModelLoadError(
                f"the schedulers serve different models or tokenizers ({others});"
                f" a tokenizer replica serves one model, {address} differs"
            )
    return replace(first, max_model_len=min(d.max_model_len for d in answers.values()))
