"""Factories and a fake worker for scheduler tests: no gRPC, no model, hand-built results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, StepResult, TokenEvent
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

EOS_TOKEN_ID = 2
BLOCK_SIZE = 16


def create_scheduler(num_blocks: int = 1000, **config_overrides: Any) -> Scheduler:
    config_overrides.setdefault("block_size", BLOCK_SIZE)
    config_overrides.setdefault("watermark", 0.0)
    return Scheduler(SchedulerConfig(**config_overrides), num_blocks)


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
    (computed from the scheduler's view; `tokens` overrides the sampled id per request)."""
    sampled = {}
    for request_id, num_scheduled in plan.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        if request.num_computed_tokens + num_scheduled == request.num_tokens:
            sampled[request_id] = (tokens or {}).get(request_id, default)
    return StepResult(step_id=plan.step_id, sampled_token_ids=sampled)


@dataclass
class FakeWorker:
    """Mirrors the worker's persistent batch from plans alone, and checks each plan is coherent:
    every scheduled id is known, its block table covers the tokens it computes."""

    block_size: int = BLOCK_SIZE
    sample: Callable[[str, int], int] = lambda request_id, position: 7
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    num_computed: dict[str, int] = field(default_factory=dict)

    def step(self, plan: BatchPlan) -> StepResult:
        for request_id in plan.finished_ids:
            assert request_id in self.token_ids, f"dropping unknown {request_id}"
            del self.token_ids[request_id], self.block_tables[request_id]
            del self.num_computed[request_id]
        for seq in plan.new_sequences:
            assert seq.request_id not in self.token_ids, f"{seq.request_id} sent twice"
            self.token_ids[seq.request_id] = list(seq.token_ids)
            self.block_tables[seq.request_id] = list(seq.block_ids)
            self.num_computed[seq.request_id] = seq.num_computed_tokens
        for delta in plan.block_deltas:
            self.block_tables[delta.request_id].extend(delta.new_block_ids)
        sampled = {}
        for request_id, num_scheduled in plan.num_scheduled_tokens.items():
            end = self.num_computed[request_id] + num_scheduled
            tokens = self.token_ids[request_id]
            assert num_scheduled > 0 and end <= len(tokens), (request_id, end, len(tokens))
            assert len(self.block_tables[request_id]) * self.block_size >= end, request_id
            self.num_computed[request_id] = end
            if end == len(tokens):
                token = self.sample(request_id, end)
                tokens.append(token)
                sampled[request_id] = token
        return StepResult(step_id=plan.step_id, sampled_token_ids=sampled)


def run_until_done(
    scheduler: Scheduler, worker: FakeWorker | None = None, max_steps: int = 10_000
) -> dict[str, list[TokenEvent]]:
    """Step until nothing is left, checking integrity each step; events grouped by request."""
    worker = worker or FakeWorker(block_size=scheduler.config.block_size)
    events: dict[str, list[TokenEvent]] = {}
    for step in range(max_steps):
        plan = scheduler.schedule(now=float(step))
        for event in scheduler.update(plan, worker.step(plan), now=float(step)):
            events.setdefault(event.request_id, []).append(event)
        scheduler.check_integrity()
        for request in scheduler.running:  # the plans kept the worker's block tables in sync
            table = scheduler.kv.get_block_table(request.request_id)
            assert worker.block_tables[request.request_id] == table, request.request_id
        if not scheduler.has_unfinished_requests():
            return events
    raise AssertionError("scheduler did not finish")
