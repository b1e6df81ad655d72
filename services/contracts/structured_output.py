"""Structured output (constrained decoding) as a request carries it: which language the
output must belong to (a JSON schema, any JSON object, a regex, an EBNF grammar) and its text.

Pure data, shared by the three tiers: the tokenizer tier validates and compiles it, the
scheduler only holds it (and waits for the worker to have it compiled), the worker matches
every sampled token against it. The compiling itself is services/common/grammar.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from services.contracts.errors import InvalidRequestError

MAX_STRUCTURED_OUTPUT_CHARS = 64 * 1024
"""The largest schema, regex or grammar accepted: compile time and the compiled grammar's
memory grow with it, and real tool schemas are a few KiB."""


MAX_STARTS_AFTER_IDS = 16
"""A tag that opens the grammar is a few tokens at most."""


class StructuredOutputKind(StrEnum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    STRUCTURAL_TAG = "structural_tag"
    """xgrammar's structural tag (JSON): free text, and a schema inside each triggered tag
    (how strict tools hold a model's own call syntax to their schemas)."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Frozen and hashable: the key of the compiled-grammar caches (one compile per spec)."""

    kind: StructuredOutputKind
    text: str = ""
    """The schema (JSON text), regex or grammar; empty for json_object."""
    starts_after: tuple[int, ...] = ()
    """The grammar applies once the output has produced these ids (a reasoning model's
    `</think>`): the thinking before them is free. Empty: from the first token."""

    @property
    def field(self) -> str:
        """As the public API names it: structured_output.<kind>."""
        return f"structured_output.{self.kind.value}"

    def validate(self) -> None:
        """Cheap checks (the compile, which finds the rest, is the caller's)."""
        if len(self.starts_after) > MAX_STARTS_AFTER_IDS or any(t < 0 for t in self.starts_after):
            raise InvalidRequestError(
                f"{self.field}.starts_after", f"at most {MAX_STARTS_AFTER_IDS} token ids >= 0"
            )
        if self.kind is StructuredOutputKind.JSON_OBJECT:
            if self.text:
                raise InvalidRequestError(self.field, "takes no text")
            return
        if not self.text.strip():
            raise InvalidRequestError(self.field, "must not be empty")
        if len(self.text) > MAX_STRUCTURED_OUTPUT_CHARS:
            raise InvalidRequestError(
                self.field,
                f"has {len(self.text)} characters, over the limit of {MAX_STRUCTURED_OUTPUT_CHARS}",
            )
