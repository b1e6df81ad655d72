"""Role-aware routing (pure logic; docs/disaggregation.md): which schedulers take requests, and
whether a request's prompt is prefilled on a prefill pair first.

Requests go to `decode` and `both` schedulers (the routing policy picks among them). A prompt
of at least `min_prompt_tokens` tokens, run with one choice, no logprobs and no grammar, also
names a prefill scheduler: the least loaded `prefill` one whose stats answer. With none
answering, the decode pair prefills it itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.contracts.sampling_params import SamplingParams
from services.tokenizer.routing.policy import SchedulerLoad

PREFILL_ROLE = "prefill"


def takes_requests(role: str | None) -> bool:
    """Whether routing may send a request to a scheduler of this role (None: its stats do not
    answer, so its role is unknown: it stays a candidate, as the policy decides)."""
    return role != PREFILL_ROLE


@dataclass(frozen=True, slots=True)
class PrefillCandidate:
    address: str
    role: str | None
    """None when its stats do not answer (it is then no candidate)."""
    load: SchedulerLoad | None


def wants_remote_prefill(
    num_prompt_tokens: int, sampling: SamplingParams, min_prompt_tokens: int
) -> bool:
    """Whether a request is worth a prefill pair (a short prompt costs its decode pair little)
    and can use one (the prefill pair samples only the first token of one choice)."""
    return (
        num_prompt_tokens >= min_prompt_tokens
        and sampling.n == 1
        and not sampling.logprobs
        and sampling.structured_output is None
    )


def choose_prefill(candidates: Sequence[PrefillCandidate], turn: int = 0) -> str | None:
    """The least loaded answering prefill scheduler (ties in turn), or None when none answers."""
    answering = [c for c in candidates if c.role == PREFILL_ROLE and c.load is not None]
    if not answering:
        return None
    least = min(c.load.total for c in answering if c.load is not None)
    tied = [c for c in answering if c.load is not None and c.load.total == least]
    return tied[turn % len(tied)].address
