"""Strict tools under `tool_choice: auto`: the model may call or not, but a call it opens, in
its family's syntax, follows the tool's schema (tool_request.strict_call_grammar: a
structural tag). A preparation step (preparation.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.contracts.errors import InvalidRequestError
from services.tokenizer.tool_request import strict_call_grammar
from services.tokenizer.validation import ValidatedRequest


@dataclass(frozen=True, slots=True)
class StrictTools:
    tool_call_parser: str
    """The served model's call syntax (--tool-call-parser, auto resolved)."""

    async def apply(self, request: ValidatedRequest) -> ValidatedRequest:
        tools = request.tool_request
        grammar = strict_call_grammar(tools, self.tool_call_parser) if tools else None
        if grammar is None:
            return request
        if request.sampling.structured_output is not None:
            raise InvalidRequestError(
                "tools",
                f"strict tools hold calls to their schemas by a grammar, which "
                f"{request.structured_output_param} would replace: send one",
            )
        sampling = replace(request.sampling, structured_output=grammar)
        return replace(request, sampling=sampling, structured_output_param="tools")
