"""A request's grammar is compiled at the edge (once per distinct spec, on a thread: a compile
takes 10-100 ms), so that a spec xgrammar refuses never reaches a scheduler: 400 naming the
parameter that carried it. The workers compile their own. A preparation step
(preparation.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.common.grammar import GrammarCompiler
from services.contracts.errors import InvalidRequestError
from services.tokenizer.validation import ValidatedRequest


@dataclass(frozen=True, slots=True)
class GrammarCheck:
    grammars: GrammarCompiler

    async def apply(self, request: ValidatedRequest) -> ValidatedRequest:
        spec = request.sampling.structured_output
        if spec is None:
            return request
        try:
            await asyncio.to_thread(self.grammars.compile, spec)
        except InvalidRequestError as exc:
            raise InvalidRequestError(request.structured_output_param, exc.message) from None
        return request
