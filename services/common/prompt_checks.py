"""Checks every entry point applies to prompt token ids (pure): the tokenizer tier, the
scheduler's Engine API and the in-process engine raise the same errors for the same input."""

from __future__ import annotations

from collections.abc import Sequence

from services.contracts.errors import InvalidRequestError, PromptTooLongError


def check_token_ids(field_name: str, token_ids: Sequence[int], vocab_size: int) -> None:
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                field_name,
                f"token id {token_id} at index {index} is outside the vocabulary [0, {vocab_size})",
            )


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens == 0:
        raise InvalidRequestError("prompt", "must not be empty")
    if num_tokens >= max_model_len:
        raise PromptTooLongError(
            "prompt",
            f"the prompt has {num_tokens} tokens but the context length is "
            f"{max_model_len} (at least one token must be left to generate)",
        )
