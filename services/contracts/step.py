"""The contract between the scheduler and the worker: a plan per step, a result per step.

A plan is a *delta* against the worker's persistent batch. A sequence is sent whole once
(`NewSequence`); after that only what changed travels (new blocks, tokens to compute). The
worker keeps each sequence's token ids and block table and appends the tokens it samples
itself, so a decode step for a large batch stays a few bytes per sequence.

Token regions of one sequence, as both sides see them:

    token_ids:  [ prompt ............................ | output ......... ]
                 ^0              ^num_computed_tokens                   ^len(token_ids)
                 |-- KV in cache--|-- scheduled this step (n) --|
A step computes tokens [num_computed_tokens, num_computed_tokens + n). When that range reaches
the end of token_ids the worker samples one token for the sequence and appends it; a partial
prefill chunk samples nothing.

Speculation (n-gram drafts): a decoding sequence may also get draft slots. The worker then
guesses up to that many next tokens from the sequence's own context, computes them in the same
forward as extra rows, and keeps the drafts the model agrees with; the step emits the accepted
drafts and then one sampled token (1 to slots + 1 tokens). The scheduler has reserved KV for
every slot, and counts only the emitted tokens as computed once the result arrives: the KV a
rejected draft wrote sits past the sequence's end and is overwritten by the next tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from services.contracts.kv_transfer import KvDestination, KvExport
from services.contracts.sampling_params import SamplingParams


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop token id (stop strings are the tokenizer tier's)
    LENGTH = "length"  # max_new_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client
    DEADLINE = "deadline"  # the request's deadline passed (queued or running)


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker has not seen (or has dropped, after a preemption)."""

    request_id: str
    token_ids: list[int]
    """Prompt plus any output already generated (a resumed, preempted request)."""
    num_prompt_tokens: int
    """token_ids[:num_prompt_tokens] is the prompt; the rest is output (for penalties)."""
    block_ids: list[int]
    """Block table: block i holds the KV of tokens [i*block_size, (i+1)*block_size). With a
    sliding window on every layer, leading entries may be negative: blocks before the window
    that the sequence no longer holds, never read."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hit)."""
    sampling: SamplingParams
    lora_name: str = ""
    """The LoRA adapter the sequence runs with (loaded on the worker); empty = the base
    model. An adapter the worker cannot serve fails this sequence alone
    (StepResult.failed_sequences)."""
    cache_salt: bytes = b""
    """The request's prefix-cache salt (its tenant): the worker's suffix decoding drafts a
    sequence only from text of the same salt and adapter."""
    kv_destination: KvDestination | None = None
    """A prefill pair's sequence: once its first token is sampled, its prompt's blocks go to
    this decode worker (services/worker/kv_transfer.py)."""


FAILED_DISK_LOAD_PREFIX = "kv disk block unavailable: "
"""The reason a new sequence fails with when a block of its `disk_loads` cannot be read: the
scheduler then computes its prefix instead."""


@dataclass(frozen=True, slots=True)
class DiskStore:
    """A full block the scheduler has just cached: the worker copies it out before the next
    forward and writes it to its KV disk tier behind the step (docs/prefix-cache.md)."""

    block_id: int
    block_hash: bytes
    lora_name: str = ""
    cache_salt: bytes = b""


@dataclass(slots=True)
class SequenceDelta:
    """Blocks appended to the block table of a sequence the worker already holds."""

    request_id: str
    new_block_ids: list[int]


@dataclass(slots=True)
class BatchPlan:
    """Everything the worker needs for one forward step."""

    step_id: int
    new_sequences: list[NewSequence] = field(default_factory=list)
    block_deltas: list[SequenceDelta] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """request_id -> tokens to compute this step; its order is the batch order."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Sequences to drop from the worker (finished, aborted, expired or preempted). Applied
    before anything else in the plan, so a preempted id may reappear in new_sequences."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) block copies to do before the forward (copy-on-write of a shared block)."""
    draft_slots: dict[str, int] = field(default_factory=dict)
    """request_id -> most draft tokens the worker may verify for this decoding sequence (its
    KV is reserved); sequences without an entry do not speculate this step."""
    block_truncations: dict[str, int] = field(default_factory=dict)
    """request_id -> the number of blocks its table keeps: the scheduler freed the tail it had
    reserved for drafts. Applied after finished_request_ids, before new sequences and block
    deltas."""

    disk_stores: list[DiskStore] = field(default_factory=list)
    """Cached blocks to write to the worker's KV disk tier; read out before this plan's
    writes, so a block reused by the plan is stored with its old contents."""
    disk_loads: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    """request_id of a new sequence -> (block id, chain hash) of prefix blocks to fill from
    the KV disk tier before the forward: blocks its num_computed_tokens counts as cached
    because the disk holds them. One that cannot be read fails the sequence alone."""
    kv_exports: list[KvExport] = field(default_factory=list)
    """Cached blocks another pair's request fetches: read out before this plan's writes (as
    disk stores are), then pushed. One that cannot be sent fails under its request id
    (failed_sequences), which no sequence here has."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def needs_worker(self) -> bool:
        """Anything for the worker to do: tokens to compute, sequences to take on or drop,
        blocks to copy. A plan without any is applied by the scheduler alone."""
        return bool(
            self.num_scheduled_tokens
            or self.finished_request_ids
            or self.new_sequences
            or self.block_copies
            or self.block_truncations
            or self.disk_stores
            or self.kv_exports
        )

    def without(self, request_ids: set[str] | frozenset[str]) -> BatchPlan:
        """A copy that leaves `request_ids` out, as if they were never in the batch (the
        sequences a worker could not take on)."""
        return replace(
            self,
            new_sequences=[s for s in self.new_sequences if s.request_id not in request_ids],
            block_deltas=[d for d in self.block_deltas if d.request_id not in request_ids],
            num_scheduled_tokens={
                rid: n for rid, n in self.num_scheduled_tokens.items() if rid not in request_ids
            },
            draft_slots={rid: n for rid, n in self.draft_slots.items() if rid not in request_ids},
            disk_loads={rid: b for rid, b in self.disk_loads.items() if rid not in request_ids},
            block_truncations={
                rid: n for rid, n in self.block_truncations.items() if rid not in request_ids
            },
        )


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the sampled token and of the top alternatives (raw model output)."""

    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


DRAFT_PROPOSERS = ("ngram", "suffix")
"""The worker's model-free draft proposers (services/worker/speculative/)."""


@dataclass(slots=True)
class StepResult:
    """What the worker sends back: one sampled token per sequence that reached its end, after
    the drafts it accepted (a speculating sequence's tokens this step are
    accepted_draft_ids[rid] + [sampled_token_ids[rid]])."""

    step_id: int
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens the model agreed with, in order; only sequences that accepted any."""
    num_proposed_drafts: dict[str, int] = field(default_factory=dict)
    """Draft tokens verified per speculating sequence (0 to its slots: the context may offer
    no guess); only sequences that proposed any."""
    draft_proposers: dict[str, str] = field(default_factory=dict)
    """What guessed each verified draft (DRAFT_PROPOSERS: prompt lookup in the sequence's
    own tokens, or suffix decoding over recent requests' text), for the metrics; the
    sequences of num_proposed_drafts."""
    failed_sequences: dict[str, str] = field(default_factory=dict)
    """New sequences the worker could not take on (their LoRA adapter is not loaded, or no
    adapter slot is free), with the reason: they were left out of the step and every later
    one until the scheduler drops them (finished_request_ids)."""
    disk_added: list[bytes] = field(default_factory=list)
    """Chain hashes written to the worker's KV disk tier since the last step."""
    disk_evicted: list[bytes] = field(default_factory=list)
    """Chain hashes gone from the KV disk tier since the last step (LRU, refused, tier off)."""

    def token_ids(self, request_id: str) -> list[int]:
        """Every token the step emitted for a sequence, in order ([] if none)."""
        sampled = self.sampled_token_ids.get(request_id)
        if sampled is None:
            return []
        return [*self.accepted_draft_ids.get(request_id, ()), sampled]


@dataclass(slots=True)
class TokenEvent:
    """What the scheduler tells the request's owner after a step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    index: int = 0
    """The choice (0..n-1) of a request with n > 1 choices; finish_reason is this choice's."""
    num_unfinished_choices: int = 0
    """Choices of the request still running after this event (0 once the last has finished)."""

    @property
    def finished(self) -> bool:
        """This choice has finished."""
        return self.finish_reason is not None

    @property
    def request_finished(self) -> bool:
        """Every choice of the request has finished: nothing more comes for it."""
        return self.finish_reason is not None and self.num_unfinished_choices == 0
