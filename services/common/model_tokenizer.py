"""The model's tokenizer and chat template, from a HF directory or a GGUF file's metadata."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.common.chat_template import ChatMessage, ChatTemplate
from services.common.errors import ModelLoadError
from services.common.gguf_tokenizer import normalizer_shrink_factor, read_gguf_tokenizer
from services.common.model_description import ModelDescription


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
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.chat_template_source = chat_template
        bos = tokenizer.id_to_token(bos_token_id) if bos_token_id is not None else None
        eos = tokenizer.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        self.chat_template = ChatTemplate(chat_template, bos_token=bos or "", eos_token=eos or "")

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

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        # A template that starts with the BOS text already carries it; don't add a second one.
        return self.encode(text, add_special_tokens=not text.startswith(self._bos_text))

    def encode_chat_after_prefix(
        self,
        prefix_messages: Sequence[ChatMessage],
        prefix_ids: Sequence[int],
        messages: Sequence[ChatMessage],
    ) -> list[int]:
        """Ids of the conversation prefix_messages + messages, reusing `prefix_ids` (the
        prefix rendered alone, without a generation prompt) instead of tokenizing it again.

        Sound only when the rest of the rendered text starts with a special token: special
        tokens are split out before BPE, so no merge can cross that boundary. Otherwise (or
        if the template renders the prefix differently in context) it tokenizes everything.
        """
        conversation = [*prefix_messages, *messages]
        full = self.chat_template.render(conversation, add_generation_prompt=True)
        prefix = self.chat_template.render(prefix_messages, add_generation_prompt=False)
        rest = full[len(prefix) :]
        if full.startswith(prefix) and rest.startswith(self._special_texts):
            return [*prefix_ids, *self.tokenizer.encode(rest, add_special_tokens=False).ids]
        return self.apply_chat_template(conversation)

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
            chat_template=self.chat_template_source,
            bos_token_id=self.bos_token_id,
            eos_token_ids=tuple(dict.fromkeys((*self.eos_token_ids, *eos_token_ids))),
            add_bos_token=self.add_bos_token,
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
        template = config.get("chat_template")
        if template is None and (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()

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
            chat_template=template if isinstance(template, str) else None,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    @classmethod
    def from_gguf(cls, path: Path) -> ModelTokenizer:
        """The tokenizer llama.cpp builds from the file's metadata (see gguf_tokenizer)."""
        gguf = read_gguf_tokenizer(path)
        return cls(
            gguf.tokenizer,
            chat_template=gguf.chat_template,
            bos_token_id=gguf.bos_token_id,
            eos_token_ids=gguf.eos_token_ids,
            add_bos_token=gguf.add_bos_token,
        )
