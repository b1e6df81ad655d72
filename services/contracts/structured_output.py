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


class StructuredOutputKind(StrEnum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Frozen and hashable: the key of the compiled-grammar caches (one compile per spec)."""

    kind: StructuredOutputKind
    text: str = ""
    """The schema (JSON text), regex or grammar; empty for json_object."""

    @property
    def field(self) -> str:
        """As the public API names it: structured_output.<kind>."""
        return f"structured_output.{self.kind.value}"

    def validate(self) -> None:
        """Cheap checks (the compile, which finds the rest, is the caller's)."""
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
