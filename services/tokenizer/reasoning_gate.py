"""A reasoning model's grammar (structured output, a forced tool call) applies to its answer
only: it starts after the end-of-thinking tag, unless the prompt already ended the thinking
(a template that closes it for the model). A preparation step (preparation.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.text.reasoning import prompt_closes_reasoning
from services.tokenizer.served_model import ServedModel
from services.tokenizer.validation import ValidatedRequest

# Prompt tokens read to see whether the template already closed the thinking (`<think>\n\n
# </think>\n\n` and what follows it: a handful of tokens).
REASONING_PROMPT_TAIL = 32


@dataclass(frozen=True, slots=True)
class GrammarAfterReasoning:
    model: ServedModel

    async def apply(self, request: ValidatedRequest) -> ValidatedRequest:
        model = self.model
        spec = request.sampling.structured_output
        if spec is None or not request.is_chat or model.reasoning_parser is None:
            return request
        tail = model.tokenizer.decode(
            list(request.prompt_token_ids[-REASONING_PROMPT_TAIL:]), skip_special_tokens=False
        )
        if prompt_closes_reasoning(tail):
            return request
        gated = replace(spec, starts_after=model.reasoning_end_ids)
        return replace(request, sampling=replace(request.sampling, structured_output=gated))
