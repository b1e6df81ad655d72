"""What the tokenizer tier knows about the served model: the worker reports it (Describe),
its scheduler passes it on, and the tokenizer tier builds its tokenizer from it, so only the
workers ever open the model file."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelDescription:
    model_name: str
    vocab_size: int
    max_model_len: int
    """The context length, after the worker's --max-model-len."""
    tokenizer_json: str
    """The Hugging Face `tokenizers` JSON (`Tokenizer.to_str()`)."""
    chat_template: str | None
    """The model's Jinja chat template; None: it has none (chat requests are refused)."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    """The tokenizer's first (the chat template's eos_token), then the model config's."""
    add_bos_token: bool
    tool_use_chat_template: str | None = None
    """The model's `tool_use` template, used instead for requests that carry tools."""
    special_tokens: tuple[tuple[str, str], ...] = ()
    """(name, text) of the tokenizer's named special tokens (bos_token, eos_token, unk_token,
    pad_token ...), sorted by name: the variables the chat template sees."""
