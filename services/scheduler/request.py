"""A request as the scheduler core tracks it: prompt, outputs so far, and how much KV is computed.

What a feature knows of a request (its choices, drafts in flight, grammar, ...) is kept by that
feature, by request id (services/scheduler/features/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from services.contracts.kv_transfer import KvDestination
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import FinishReason, NewSequence


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

    def advance(self, num_new: int) -> None:
        """Count `num_new` scheduled tokens as computed now, so the next plan can be made
        before this one's result arrives; a step that reaches the sequence's end samples a
        pending token."""
        self.num_computed_tokens += num_new
        if self.num_computed_tokens == self.num_tokens_with_pending:
            self.num_pending_tokens += 1

    def append_output(
        self, token_ids: list[int], max_model_len: int
    ) -> tuple[list[int], FinishReason | None]:
        """Append a step's tokens up to the first that ends the sequence (those after a stop
        are dropped). Returns the tokens appended and why the sequence ended (None: it goes
        on)."""
        for num_appended, token_id in enumerate(token_ids, 1):
            self.output_token_ids.append(token_id)
            reason = self.stop_reason(token_id, max_model_len)
            if reason is not None:
                return token_ids[:num_appended], reason
        return list(token_ids), None

    def stop_reason(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Why the sequence ends with `token_id` just appended (None: it goes on)."""
        sampling = self.sampling
        if self.num_output_tokens > sampling.min_new_tokens and (
            token_id in sampling.stop_token_ids
            or (not sampling.ignore_eos and token_id in self.eos_token_ids)
        ):
            return FinishReason.STOP
        if self.num_output_tokens >= sampling.max_new_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def new_sequence(
        self, block_table: list[int], kv_destination: KvDestination | None = None
    ) -> NewSequence:
        """The sequence whole, as a worker that has not seen it (or dropped it) gets it;
        `kv_destination`: where a prefill pair sends its prompt's KV."""
        return NewSequence(
            request_id=self.request_id,
            token_ids=self.all_token_ids,
            num_prompt_tokens=self.num_prompt_tokens,
            block_ids=list(block_table),
            num_computed_tokens=self.num_computed_tokens,
            sampling=self.sampling,
            lora_name=self.lora_name,
            cache_salt=self.cache_salt,
            kv_destination=kv_destination,
        )

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) across the prompt/output boundary, without copying both."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
