"""A request's preparation after validation, as the steps its features contribute: each takes
the validated request and returns it, changed or not, or raises InvalidRequestError naming
the parameter at fault. `Generator.prepare` runs them in order (preparation_steps), between
validation and routing:

    strict_tools.StrictTools              strict tools under auto: their calls held to
                                          their schemas by a grammar
    reasoning_gate.GrammarAfterReasoning  a reasoning model's grammar starts after its
                                          thinking
    grammar_check.GrammarCheck            the request's grammar compiles (else 400), once
                                          per distinct spec

A new feature that changes what reaches the scheduler adds a step here, not a branch in the
Generator.
"""

from __future__ import annotations

from typing import Protocol

from services.common.grammar import GrammarCompiler
from services.tokenizer.grammar_check import GrammarCheck
from services.tokenizer.reasoning_gate import GrammarAfterReasoning
from services.tokenizer.served_model import ServedModel
from services.tokenizer.strict_tools import StrictTools
from services.tokenizer.validation import ValidatedRequest


class PreparationStep(Protocol):
    async def apply(self, request: ValidatedRequest) -> ValidatedRequest: ...


def preparation_steps(model: ServedModel, grammars: GrammarCompiler) -> tuple[PreparationStep, ...]:
    """In order: the grammars a request gets (strict tools), where they start (after the
    thinking), then the check that they compile."""
    return (
        StrictTools(model.tool_call_parser),
        GrammarAfterReasoning(model),
        GrammarCheck(grammars),
    )
