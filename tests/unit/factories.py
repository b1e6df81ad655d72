"""Factories and a fake worker for scheduler tests: no gRPC, no model, hand-built results."""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, StepResult, TokenEvent
from services.scheduler.config import SchedulerConfig
from services.scheduler.features.sliding_window import RELEASED_BLOCK
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

EOS_TOKEN_ID = 2
BLOCK_SIZE = 16


def create_scheduler(
    num_blocks: int = 1000, *, sliding_window: int = 0, max_loras: int = 0, **config_overrides: Any
) -> Scheduler:
    config_overrides.setdefault("block_size", BLOCK_SIZE)
    config_overrides.setdefault("watermark", 0.0)
    config_overrides.setdefault("debug_checks", True)  # integrity checked after every step
    return Scheduler(
        SchedulerConfig(**config_overrides),
        num_blocks,
        sliding_window=sliding_window,
        max_loras=max_loras,
    )


def create_requests(
    num_requests: int,
    num_tokens: int | list[int] = 10,
    max_new_tokens: int = 16,
    *,
    prefix: list[int] | None = None,
    id_prefix: str = "req",
    arrival_time: float = 0.0,
    deadline: float | None = None,
    **sampling_overrides: Any,
) -> list[Request]:
    """Requests with distinct prompts (token ids never collide with EOS) after a shared prefix."""
    lengths = num_tokens if isinstance(num_tokens, list) else [num_tokens] * num_requests
    sampling = SamplingParams(max_new_tokens=max_new_tokens, **sampling_overrides)
    requests = []
    for i, length in enumerate(lengths):
        shared = list(prefix or [])
        own = [1000 + 100 * i + j for j in range(length - len(shared))]
        requests.append(
            Request(
                request_id=f"{id_prefix}{i}",
                prompt_token_ids=shared + own,
                sampling=sampling,
                eos_token_ids=(EOS_TOKEN_ID,),
                arrival_time=arrival_time + i,
                deadline=deadline,
            )
        )
    return requests


def result_for(
    scheduler: Scheduler, plan: BatchPlan, tokens: dict[str, int] | None = None, default: int = 7
) -> StepResult:
    """A result sampling one token for each request whose scheduled range reaches its end
    (from the scheduler's view right after `schedule`, with no other plan in flight: such a
    plan left the request one pending token; `tokens` overrides the sampled id per request)."""
    sampled = {}
    for request_id in plan.num_scheduled_tokens:
        if scheduler.requests[request_id].num_pending_tokens:
            sampled[request_id] = (tokens or {}).get(request_id, default)
    return StepResult(step_id=plan.step_id, sampled_token_ids=sampled)


@dataclass
class FakeWorker:
    """Mirrors the worker's persistent batch from plans alone, and checks each plan is coherent:
    every scheduled id is known, its block table covers the tokens it computes, and the KV it
    reads (every position before the ones it computes, or within `sliding_window` of them)
    holds that sequence's own tokens, as written by an earlier step into those blocks (prefix
    hits, copies and reuse included). As a model does in each layer, a step writes every
    sequence's KV before any sequence reads: a block one sequence still reads and another
    writes in the same step is caught."""

    block_size: int = BLOCK_SIZE
    sliding_window: int = 0
    """The model's window on every layer (0: none): positions before it are never read."""
    sample: Callable[[str, int], int] = lambda request_id, position: 7
    guess: Callable[[str, int], int] | None = None
    """Speculation: the draft token proposed for a position (None: never proposes). A draft
    is accepted when it is what `sample` gives there, as greedy verification does."""
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    num_computed: dict[str, int] = field(default_factory=dict)
    kv: dict[tuple[int, int], int] = field(default_factory=dict)
    """(block, offset) -> the token whose KV the slot holds."""
    max_loras: int = 0
    """LoRA slots: the sequences it holds may use at most this many distinct adapters."""
    missing_loras: set[str] = field(default_factory=set)
    """Adapters it does not hold: a new sequence naming one fails (left out of every plan
    until it is dropped), as the worker's lora/adapters.py does."""
    lora_names: dict[str, str] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)

    def step(self, plan: BatchPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            if request_id in self.failed:
                self.failed.discard(request_id)
                continue
            assert request_id in self.token_ids, f"dropping unknown {request_id}"
            del self.token_ids[request_id], self.block_tables[request_id]
            del self.num_computed[request_id]
            self.lora_names.pop(request_id, None)
        failed_now = {
            seq.request_id: f"lora_name: no adapter {seq.lora_name!r} is loaded"
            for seq in plan.new_sequences
            if seq.lora_name in self.missing_loras
        }
        self.failed |= failed_now.keys()
        if self.failed:
            plan = plan.without(self.failed)
        for request_id, num_kept in plan.block_truncations.items():
            table = self.block_tables[request_id]
            assert num_kept * self.block_size > self.num_computed[request_id], request_id
            del table[num_kept:]
        for seq in plan.new_sequences:
            assert seq.request_id not in self.token_ids, f"{seq.request_id} sent twice"
            self.token_ids[seq.request_id] = list(seq.token_ids)
            self.block_tables[seq.request_id] = list(seq.block_ids)
            self.num_computed[seq.request_id] = seq.num_computed_tokens
            if seq.lora_name:
                self.lora_names[seq.request_id] = seq.lora_name
        assert len(set(self.lora_names.values())) <= self.max_loras, self.lora_names
        for delta in plan.block_deltas:
            self.block_tables[delta.request_id].extend(delta.new_block_ids)
        for src, dst in plan.block_copies:
            for offset in range(self.block_size):
                if (src, offset) in self.kv:
                    self.kv[(dst, offset)] = self.kv[(src, offset)]
        result = StepResult(step_id=plan.step_id, failed_sequences=failed_now)
        steps: dict[str, tuple[int, int, list[int]]] = {}
        for request_id, num_scheduled in plan.num_scheduled_tokens.items():
            start = self.num_computed[request_id]
            end = start + num_scheduled
            tokens = self.token_ids[request_id]
            table = self.block_tables[request_id]
            assert num_scheduled > 0 and end <= len(tokens), (request_id, end, len(tokens))
            drafts = self._drafts(plan, request_id, end == len(tokens))
            # The drafts' KV is written too (after the scheduled tokens), accepted or not.
            assert len(table) * self.block_size >= end + len(drafts), request_id
            for position, token in enumerate([*tokens[start:end], *drafts], start):
                self.kv[(table[position // self.block_size], position % self.block_size)] = token
            steps[request_id] = (start, end, drafts)
        for request_id, (start, _, _) in steps.items():
            tokens, table = self.token_ids[request_id], self.block_tables[request_id]
            first_read = max(0, start - self.sliding_window + 1) if self.sliding_window else 0
            for position in range(first_read, start):
                slot = (table[position // self.block_size], position % self.block_size)
                assert self.kv.get(slot) == tokens[position], (request_id, position, slot)
        for request_id, (_, end, drafts) in steps.items():
            tokens = self.token_ids[request_id]
            self.num_computed[request_id] = end
            if end < len(tokens):
                continue
            accepted: list[int] = []
            for draft in drafts:
                if draft != self.sample(request_id, end + len(accepted)):
                    break
                accepted.append(draft)
            token = self.sample(request_id, end + len(accepted))
            tokens.extend([*accepted, token])
            self.num_computed[request_id] = end + len(accepted)
            result.sampled_token_ids[request_id] = token
            if drafts:
                result.num_proposed_drafts[request_id] = len(drafts)
                result.draft_proposers[request_id] = "ngram"
                if accepted:
                    result.accepted_draft_ids[request_id] = accepted
        return result

    def _drafts(self, plan: BatchPlan, request_id: str, samples: bool) -> list[int]:
        num_slots = plan.draft_slots.get(request_id, 0)
        if num_slots:
            assert samples and plan.num_scheduled_tokens[request_id] == 1, request_id
        if self.guess is None or not num_slots:
            return []
        end = len(self.token_ids[request_id])
        return [self.guess(request_id, end + j) for j in range(num_slots)]


def modelled_step_seconds(plan: BatchPlan, result: StepResult) -> float:
    """A memory-bound step: 10 ms, and 0.1 ms per token computed (drafts included)."""
    num_drafts = sum(result.num_proposed_drafts.values())
    return 0.010 + 0.0001 * (plan.total_num_scheduled_tokens + num_drafts)


_WORKERS: weakref.WeakKeyDictionary[Scheduler, FakeWorker] = weakref.WeakKeyDictionary()


def worker_of(scheduler: Scheduler) -> FakeWorker:
    """The scheduler's one fake worker, kept across runs: the KV it wrote stays readable by
    later prefix hits, as on a real worker."""
    if scheduler not in _WORKERS:
        _WORKERS[scheduler] = FakeWorker(
            block_size=scheduler.config.block_size,
            sliding_window=scheduler.kv.sliding_window,
            max_loras=scheduler.loras.max_loras,
        )
    return _WORKERS[scheduler]


def check_reads_are_held(scheduler: Scheduler, worker: FakeWorker, plan: BatchPlan) -> None:
    """Every block the plan's queries read (the window before its first scheduled token) is
    one the scheduler still holds for that sequence: none was released too early."""
    block_size, window = worker.block_size, worker.sliding_window
    starts = {seq.request_id: seq.num_computed_tokens for seq in plan.new_sequences}
    for request_id in plan.num_scheduled_tokens:
        start = starts[request_id] if request_id in starts else worker.num_computed[request_id]
        first = max(0, start - window + 1) if window else 0
        table = scheduler.kv.get_block_table(request_id)
        for index in range(first // block_size, -(-start // block_size)):
            assert table[index] != RELEASED_BLOCK, (request_id, index, start)


def check_worker_in_sync(scheduler: Scheduler, worker: FakeWorker) -> None:
    """Integrity, and the block tables the plans gave the worker are the scheduler's (where
    the scheduler released a block before the window, the worker may keep any id)."""
    scheduler.check_integrity()
    for request in scheduler.running:
        table = scheduler.kv.get_block_table(request.request_id)
        held = worker.block_tables[request.request_id]
        assert len(held) == len(table), request.request_id
        for ours, theirs in zip(table, held, strict=True):
            assert ours in (RELEASED_BLOCK, theirs), request.request_id


def run_until_done(
    scheduler: Scheduler,
    worker: FakeWorker | None = None,
    *,
    between: Callable[[int], None] = lambda step: None,
    max_steps: int = 10_000,
) -> dict[str, list[TokenEvent]]:
    """Step until nothing is left, checking integrity each step; events grouped by request.
    `between(step)` runs after each update (aborts, new requests)."""
    worker = worker or worker_of(scheduler)
    events: dict[str, list[TokenEvent]] = {}
    for step in range(max_steps):
        plan = scheduler.schedule(now=float(step))
        check_reads_are_held(scheduler, worker, plan)
        result = worker.step(plan)
        scheduler.observe_step(plan, result, modelled_step_seconds(plan, result))
        for event in scheduler.update(plan, result, now=float(step)):
            events.setdefault(event.request_id, []).append(event)
        check_worker_in_sync(scheduler, worker)
        between(step)
        if not scheduler.has_unfinished_requests():
            return events
    raise AssertionError("scheduler did not finish")


def run_overlapped(
    scheduler: Scheduler,
    worker: FakeWorker | None = None,
    *,
    between: Callable[[int], None] = lambda step: None,
    max_steps: int = 10_000,
) -> dict[str, list[TokenEvent]]:
    """Drive the scheduler as the overlapped engine loop does: plan N+1 is made (and run by the
    in-order worker) before result N is applied. `between(step)` runs after each update and
    before the next plan (aborts, new requests). Events grouped by request."""
    worker = worker or worker_of(scheduler)
    events: dict[str, list[TokenEvent]] = {}
    in_flight: deque[tuple[BatchPlan, StepResult]] = deque()

    def apply(plan: BatchPlan, result: StepResult, step: int) -> None:
        scheduler.observe_step(plan, result, modelled_step_seconds(plan, result))
        for event in scheduler.update(plan, result, now=float(step)):
            events.setdefault(event.request_id, []).append(event)

    for step in range(max_steps):
        if not in_flight and not scheduler.has_unfinished_requests():
            return events
        if len(in_flight) < 2:
            plan = scheduler.schedule(now=float(step))
            if plan.needs_worker:
                check_reads_are_held(scheduler, worker, plan)
                in_flight.append((plan, worker.step(plan)))
                if len(in_flight) < 2:
                    continue
            else:
                apply(plan, StepResult(step_id=plan.step_id), step)
                if not in_flight:
                    between(step)
                    continue
        apply(*in_flight.popleft(), step)
        scheduler.check_integrity()
        between(step)
    raise AssertionError("scheduler did not finish")
