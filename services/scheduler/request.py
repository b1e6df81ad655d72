"""A request as the scheduler tracks it: prompt, outputs so far, and how much KV is computed."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import FinishReason, TokenEvent, TokenLogprobs

# Joins a request's id and a choice index into the forked sequence's id. A control character:
# the public doors refuse it in request ids, so a forked id never collides with a submitted one.
CHOICE_ID_SEPARATOR = "\x1f"


def choice_request_id(request_id: str, index: int) -> str:
    return f"{request_id}{CHOICE_ID_SEPARATOR}{index}"


class RequestStatus(Enum):
    WAITING = "waiting"  # queued, never admitted
    RUNNING = "running"  # holds KV blocks, scheduled every step
    PREEMPTED = "preempted"  # blocks taken back; queued again, will recompute
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One generation request.

    tokens:  [ prompt_token_ids ........ | output_token_ids .... | pending ]
              ^0    ^num_computed_tokens               ^num_tokens        ^num_scheduled_view

    num_computed_tokens counts the tokens whose KV is computed *or scheduled*: it advances when
    a plan is made, not when its result arrives, so the next plan can be made while the worker
    still runs this one (overlapped scheduling). `num_pending_tokens` are tokens the worker has
    sampled, or will sample, for plans whose results have not arrived: the worker feeds them
    itself, the scheduler learns their ids one step later.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    deadline: float | None = None
    """Absolute time (same clock as `now`) after which the request is dropped."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    num_preemptions: int = 0
    num_pending_tokens: int = 0
    """Tokens sampled on the worker for plans whose results have not arrived yet."""
    num_unconfirmed_drafts: int = 0
    """Draft slots granted in plans whose results have not arrived: the worker may have
    accepted up to that many tokens more than num_pending_tokens, so KV reserved ahead must
    cover them too."""
    cache_salt: bytes = b""
    """Mixed into the first block's hash: requests with different salts share no KV."""
    tenant_id: str = ""
    """Whose share of the scheduler the request uses (fair_share.py); "" = no tenant named."""
    tenant_weight: int = 1
    lora_name: str = ""
    """The LoRA adapter it runs with ("" = the base model); in its cache salt already."""
    pin_name: str | None = None
    """Set on a pinning request: when it finishes, its prompt's full blocks stay pinned
    under this name instead of becoming evictable."""
    grammar_ready: bool = True
    """False while the worker compiles the request's structured-output grammar: it stays
    waiting (the requests behind it may go first) so that no step waits for a compile."""
    group: ChoiceGroup | None = None
    """The choices this sequence is one of (a request with n > 1); None for n = 1."""
    choice_index: int = 0

    @property
    def public_id(self) -> str:
        """The id its owner submitted: a forked choice's events go out under it."""
        return self.group.request_id if self.group is not None else self.request_id

    @property
    def num_unforked_choices(self) -> int:
        """Choices still to fork off this sequence (only choice 0 forks; 0 once forked)."""
        if self.group is None or self.choice_index != 0:
            return 0
        return self.group.n - len(self.group.choices)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Length of the sequence as the worker holds it once every plan sent so far has run."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens_with_pending(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """A fresh list of prompt + output (O(length): not for per-step hot paths)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def event(
        self,
        token_ids: list[int],
        reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> TokenEvent:
        """What its owner hears: new tokens and/or the finish, under the submitted id."""
        if self.group is not None:
            num_unfinished = self.group.num_unfinished
        else:
            num_unfinished = 0 if reason is not None else 1
        return TokenEvent(
            request_id=self.public_id,
            new_token_ids=token_ids,
            finish_reason=reason,
            logprobs=logprobs or [],
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            index=self.choice_index,
            num_unfinished_choices=num_unfinished,
        )

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) across the prompt/output boundary, without copying both."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


@dataclass(slots=True, eq=False)
class ChoiceGroup:
    """The n sequences of one request with n > 1.

    Choice 0 is the submitted Request itself: it prefills the prompt up to its last token,
    then forks choices 1..n-1, which share its blocks (services/scheduler/features/choices.py).
    Every choice's events go out under `request_id`, with its index.
    """

    request_id: str
    n: int
    choices: list[Request] = field(default_factory=list)
    """The choices created so far, in index order (choice 0 first)."""
    num_unfinished: int = 0
    """Choices not finished yet, forked or not: the request ends when it reaches 0."""
