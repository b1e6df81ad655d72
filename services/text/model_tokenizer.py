"""The model's tokenizer and chat template, from a HF directory or a GGUF file's metadata."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.common.gguf_metadata import read_metadata
from services.contracts.errors import InvalidRequestError, ModelLoadError
from services.contracts.model_description import ModelDescription
from services.text.chat_continuation import continued_prompt
from services.text.chat_template import NO_CHAT_TEMPLATE, ChatMessage, ChatTemplate
from services.text.gguf_vocab import normalizer_shrink_factor, read_gguf_tokenizer

HF_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The special tokens a transformers tokenizer names, each a chat template variable."""

# The special token ids transformers reads from a GGUF file, by the variable they become.
_GGUF_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


class ModelTokenizer:
    """Text ↔ token ids for one model, plus its chat template and special ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool,
        special_tokens: Mapping[str, str],
        tool_use_chat_template: str | None = None,
    ) -> None:
        """`chat_template` None: the model has none, chat messages are refused.
        `special_tokens`: the tokenizer's named special tokens as text (bos_token, eos_token,
        unk_token, pad_token ...), the variables the chat template sees."""
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.special_tokens = dict(special_tokens)
        self.chat_template = (
            ChatTemplate(
                chat_template,
                tool_use_source=tool_use_chat_template,
                special_tokens=self.special_tokens,
            )
            if chat_template is not None
            else None
        )

    def with_chat_template(self, source: str) -> ModelTokenizer:
        """This tokenizer with `source` as its only chat template (--chat-template)."""
        return ModelTokenizer(
            self.tokenizer,
            chat_template=source,
            bos_token_id=self.bos_token_id,
            eos_token_ids=self.eos_token_ids,
            add_bos_token=self.add_bos_token,
            special_tokens=self.special_tokens,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        wants_bos = add_special_tokens and self.add_bos_token and self.bos_token_id is not None
        if wants_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return list(ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of a conversation (ChatTemplate.render); InvalidRequestError
        naming `messages` when the model has no chat template. `continue_final_message`:
        the answer goes on with the last message's text (chat_continuation.py) instead of
        opening a new turn."""
        if self.chat_template is None:
            raise InvalidRequestError("messages", NO_CHAT_TEMPLATE)
        rendered = self.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        if continue_final_message:
            return continued_prompt(rendered, messages[-1])
        return rendered

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message,
        )
        # A template that starts with the BOS text already carries it; don't add a second one.
        return self.encode(text, add_special_tokens=not text.startswith(self._bos_text))

    def encode_chat_after_prefix(
        self,
        prefix_messages: Sequence[ChatMessage],
        prefix_ids: Sequence[int],
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Ids of the conversation prefix_messages + messages, reusing `prefix_ids` (the
        prefix rendered alone, without a generation prompt) instead of tokenizing it again.

        Sound only when the rest of the rendered text starts with a special token: special
        tokens are split out before BPE, so no merge can cross that boundary. Otherwise (or
        if the template renders the prefix differently in context, as with tools) it
        tokenizes everything.
        """
        conversation = [*prefix_messages, *messages]
        full = self.render_chat(conversation, tools=tools)
        prefix = self.render_chat(prefix_messages, add_generation_prompt=False)
        rest = full[len(prefix) :]
        if full.startswith(prefix) and rest.startswith(self._special_texts):
            return [*prefix_ids, *self.tokenizer.encode(rest, add_special_tokens=False).ids]
        return self.apply_chat_template(conversation, tools=tools)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters of text one token can stand for: a text of n characters has
        at least n / max_chars_per_token tokens, which lets the edge refuse a prompt too long
        for the context without tokenizing it.

        A vocabulary string is never shorter than the text it stands for: byte-level BPE
        spells each byte as one character (a character is 1-4 bytes), SentencePiece's ▁ is
        one space, a byte-fallback token (<0x41>) stands for one byte, an unknown token for
        one character (never fused). So the longest string bounds it (81 for SmolLM2: a
        newline and 80 spaces), unless a normalizer shortens the text first: Unicode
        composition (NFC, NFKC) folds up to 4 characters into one (a Greek vowel with three
        accents), hence 4x then. SentencePiece's normalizers (a ▁ prepended, a space spelt ▁)
        never shorten it.
        """
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        longest = max(map(len, vocab), default=1)
        return longest * normalizer_shrink_factor(self.tokenizer.normalizer)

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        decoder = self.tokenizer.get_added_tokens_decoder()
        return tuple(token.content for token in decoder.values() if token.special) or ("\0",)

    @property
    def _bos_text(self) -> str:
        if self.bos_token_id is None:
            return "\0"
        return str(self.tokenizer.id_to_token(self.bos_token_id))

    def describe(
        self, *, model_name: str, vocab_size: int, max_model_len: int, eos_token_ids: Sequence[int]
    ) -> ModelDescription:
        """What the tokenizer tier needs to rebuild this tokenizer; `eos_token_ids` (the model
        config's) follow the tokenizer's own."""
        return ModelDescription(
            model_name=model_name,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            tokenizer_json=self.tokenizer.to_str(),
            chat_template=self.chat_template.source if self.chat_template else None,
            bos_token_id=self.bos_token_id,
            eos_token_ids=tuple(dict.fromkeys((*self.eos_token_ids, *eos_token_ids))),
            add_bos_token=self.add_bos_token,
            tool_use_chat_template=(
                self.chat_template.tool_use_source if self.chat_template else None
            ),
            special_tokens=tuple(sorted(self.special_tokens.items())),
        )

    @classmethod
    def from_description(cls, description: ModelDescription) -> ModelTokenizer:
        """The tokenizer a worker described (no model file needed)."""
        return cls(
            Tokenizer.from_str(description.tokenizer_json),
            chat_template=description.chat_template,
            bos_token_id=description.bos_token_id,
            eos_token_ids=description.eos_token_ids,
            add_bos_token=description.add_bos_token,
            special_tokens=dict(description.special_tokens),
            tool_use_chat_template=description.tool_use_chat_template,
        )

    @classmethod
    def from_path(cls, path: Path) -> ModelTokenizer:
        if path.suffix == ".gguf":
            return cls.from_gguf(path)
        return cls.from_hf_directory(path)

    @classmethod
    def from_hf_directory(cls, directory: Path) -> ModelTokenizer:
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {directory}")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config: dict[str, Any] = {}
        if (directory / "tokenizer_config.json").is_file():
            config = json.loads((directory / "tokenizer_config.json").read_text())
        model_config = json.loads((directory / "config.json").read_text())
        special_tokens = _hf_special_tokens(directory, config)
        templates = _hf_chat_templates(directory, config)

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return tokenizer.token_to_id(value) if isinstance(value, str) else None

        bos_id = token_id(config.get("bos_token"))
        if bos_id is None:
            bos_id = model_config.get("bos_token_id")
        eos = model_config.get("eos_token_id")
        eos_ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
        config_eos = token_id(config.get("eos_token"))
        if config_eos is not None and config_eos not in eos_ids:
            eos_ids.insert(0, config_eos)
        return cls(
            tokenizer,
            chat_template=templates.get("default"),
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos_token=bool(config.get("add_bos_token", False)),
            special_tokens=special_tokens,
            tool_use_chat_template=templates.get("tool_use"),
        )

    @classmethod
    def from_gguf(cls, path: Path) -> ModelTokenizer:
        """The tokenizer llama.cpp builds from the file's metadata (see gguf_vocab)."""
        gguf = read_gguf_tokenizer(path)
        metadata = read_metadata(path)
        vocab_size = gguf.tokenizer.get_vocab_size(with_added_tokens=True)
        special_tokens = {}
        for name, key in _GGUF_SPECIAL_TOKEN_KEYS.items():
            token_id = metadata.get(key)
            if token_id is not None and 0 <= int(token_id) < vocab_size:
                special_tokens[name] = str(gguf.tokenizer.id_to_token(int(token_id)))
        return cls(
            gguf.tokenizer,
            chat_template=gguf.chat_template,
            bos_token_id=gguf.bos_token_id,
            eos_token_ids=gguf.eos_token_ids,
            add_bos_token=gguf.add_bos_token,
            special_tokens=special_tokens,
        )


def _hf_chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The directory's chat templates by name ("default", "tool_use" ...), where transformers
    finds them: chat_template.jinja and additional_chat_templates/NAME.jinja when there are
    any, else tokenizer_config.json's `chat_template` (one template, or a list of named
    ones)."""
    templates: dict[str, str] = {}
    if (directory / "chat_template.jinja").is_file():
        templates["default"] = (directory / "chat_template.jinja").read_text()
    for path in sorted((directory / "additional_chat_templates").glob("*.jinja")):
        templates[path.name.removesuffix(".jinja")] = path.read_text()
    if templates:
        return templates
    configured = config.get("chat_template")
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list):
        return {
            entry["name"]: entry["template"]
            for entry in configured
            if isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("template"), str)
        }
    return {}


def _hf_special_tokens(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of tokenizer_config.json (special_tokens_map.json for those it
    lacks), as text: a value is the token or {"content": token, ...}."""
    sources: list[Mapping[str, Any]] = [config]
    if (directory / "special_tokens_map.json").is_file():
        sources.append(json.loads((directory / "special_tokens_map.json").read_text()))
    special_tokens: dict[str, str] = {}
    for name in HF_SPECIAL_TOKEN_NAMES:
        for source in sources:
            value = source.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special_tokens[name] = value
                break
    return special_tokens
