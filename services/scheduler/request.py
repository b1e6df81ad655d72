"""A request as the scheduler core tracks it: prompt, outputs so far, and how much KV is computed.

What a feature knows of a request (its choices, drafts in flight, grammar, ...) is kept by that
feature, by request id (services/scheduler/features/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import FinishReason


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
    cache_salt: bytes = b""
    """Mixed into the first block's hash: requests with different salts share no KV."""
    lora_name: str = ""
    """The LoRA adapter it runs with ("" = the base model); in its cache salt already."""

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

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) across the prompt/output boundary, without copying both."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
