"""The model this tier serves: its tokenizer and the limits the edge checks, read from the
model file's metadata (no torch, no weights)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.model_tokenizer import ModelTokenizer
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.validation import Limits


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The tokenizer plus what the edge checks need to know about the model."""

    name: str
    tokenizer: ModelTokenizer
    max_model_len: int
    vocab_size: int

    def limits(self, config: TokenizerConfig) -> Limits:
        return Limits(
            model_name=self.name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_new_tokens_limit=config.max_new_tokens_limit or self.max_model_len,
            max_stop_strings=config.max_stop_strings,
            max_stop_string_len=config.max_stop_string_len,
        )


def load_served_model(config: TokenizerConfig) -> ServedModel:
    """Reads the tokenizer and the context length from the model file's metadata, without
    torch and without the weights (slow for a GGUF file: seconds to parse the token list)."""
    from services.common.model_source import model_display_name, resolve_model_path
    from services.contracts.model_config import read_model_config

    path = resolve_model_path(config.model)
    tokenizer = ModelTokenizer.from_path(path)
    model_config = read_model_config(path)
    context_length = model_config.max_position_embeddings
    max_model_len = min(config.max_model_len or context_length, context_length)
    return ServedModel(model_display_name(path), tokenizer, max_model_len, model_config.vocab_size)
