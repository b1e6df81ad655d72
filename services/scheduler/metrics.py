"""The scheduler's metrics: queueing, step times, batch occupancy, KV blocks, token counts.

Observed once per step from data the loop already has (the plan, the events, the stats) and
once per request at admission; nothing per token. Process-wide, like the logging
configuration: one registry per process, scraped at /metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.grpc_server import rejection_reason
from services.common.metrics import LATENCY_BUCKETS_S
from services.common.redis_metrics import RedisMetrics
from services.contracts.sampling_params import MAX_SPECULATIVE_TOKENS
from services.contracts.step import DRAFT_PROPOSERS, BatchPlan, StepResult, TokenEvent
from services.scheduler.features.draft_slots import STEP_OUTCOMES
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

REGISTRY = CollectorRegistry()
REDIS = RedisMetrics(REGISTRY)

QUEUE_TIME = Histogram(
    "llmserve_queue_time_seconds",
    "From a request's arrival at the scheduler to its first admission into a step.",
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
STEP_DURATION = Histogram(
    "llmserve_step_duration_seconds",
    "One step as the scheduler sees it: plan out, worker forward and sampling, result back. "
    "step_kind: prefill (every slice > 1 token), decode (every slice 1 token) or mixed.",
    ("step_kind",),
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
RUNNING = Gauge(
    "llmserve_scheduler_running_requests", "Requests holding KV blocks.", registry=REGISTRY
)
WAITING = Gauge(
    "llmserve_scheduler_waiting_requests", "Requests queued (new or preempted).", registry=REGISTRY
)
KV_BLOCKS_USED = Gauge(
    "llmserve_kv_cache_blocks_used",
    "KV blocks held by requests (cached blocks nobody holds count as free).",
    registry=REGISTRY,
)
KV_BLOCKS_TOTAL = Gauge(
    "llmserve_kv_cache_blocks_total", "KV blocks the worker allocated.", registry=REGISTRY
)
PROMPT_TOKENS = Counter(
    "llmserve_prompt_tokens_total", "Prompt tokens of admitted requests.", registry=REGISTRY
)
GENERATION_TOKENS = Counter(
    "llmserve_generation_tokens_total",
    "Tokens sampled and delivered to requests.",
    registry=REGISTRY,
)
PREFIX_CACHE_QUERIED_TOKENS = Counter(
    "llmserve_prefix_cache_queried_tokens_total",
    "Tokens looked up in the prefix cache at admission (resumed requests included).",
    registry=REGISTRY,
)
PREFIX_CACHE_HIT_TOKENS = Counter(
    "llmserve_prefix_cache_hit_tokens_total",
    "Tokens whose KV the prefix cache already held at admission.",
    registry=REGISTRY,
)
PREEMPTIONS = Counter(
    "llmserve_preemptions_total",
    "Running requests preempted (KV dropped, to be recomputed).",
    registry=REGISTRY,
)
FORKED_BLOCK_REFS = Counter(
    "llmserve_forked_block_refs_total",
    "KV block references the choices of n > 1 requests took from their prompt instead of "
    "allocating (the prompt is computed once for all choices).",
    registry=REGISTRY,
)
BLOCK_COPIES = Counter(
    "llmserve_kv_block_copies_total",
    "Shared KV blocks copied on write (the partial last prompt block, once per forked choice).",
    registry=REGISTRY,
)
GRANTED_DRAFT_TOKENS = Counter(
    "llmserve_spec_decode_granted_tokens_total",
    "Draft slots the scheduler's policy granted (drafts it judged worth verifying).",
    registry=REGISTRY,
)
DRAFT_TOKENS = Counter(
    "llmserve_spec_decode_draft_tokens_total",
    "Draft tokens the worker proposed and verified, by proposer (ngram: prompt lookup in the "
    "sequence's own tokens; suffix: recent requests' text).",
    ("proposer",),
    registry=REGISTRY,
)
ACCEPTED_DRAFT_TOKENS = Counter(
    "llmserve_spec_decode_accepted_tokens_total",
    "Draft tokens the model agreed with, by proposer (acceptance rate: this / draft tokens).",
    ("proposer",),
    registry=REGISTRY,
)
SPECULATION_STEPS = Counter(
    "llmserve_spec_decode_steps_total",
    "Steps that decoded, by what speculation did: drafted, or why not (off, ineligible, "
    "no_budget, compute_bound, low_acceptance, no_kv_room, no_proposals).",
    ("outcome",),
    registry=REGISTRY,
)
SPECULATIVE_STEPS = Counter(
    "llmserve_spec_decode_sequence_steps_total",
    "Sequence-steps that verified drafts (mean tokens per such step: 1 + accepted / this).",
    registry=REGISTRY,
)
# Every proposer and outcome is served from the start (at 0), so a dashboard sees "off" or
# "no drafts yet" rather than a missing series.
for _proposer in DRAFT_PROPOSERS:
    DRAFT_TOKENS.labels(_proposer)
    ACCEPTED_DRAFT_TOKENS.labels(_proposer)
for _outcome in STEP_OUTCOMES:
    SPECULATION_STEPS.labels(_outcome)
TOKENS_PER_STEP = Histogram(
    "llmserve_spec_decode_tokens_per_sequence_step",
    "Tokens one speculating sequence emitted in one step (accepted drafts + 1).",
    buckets=tuple(float(n) for n in range(1, MAX_SPECULATIVE_TOKENS + 2)),
    registry=REGISTRY,
)
FINISHED = Counter(
    "llmserve_scheduler_requests_finished_total",
    "Sequences the scheduler finished (a request, or one choice of an n > 1 request), by "
    "reason (stop, length, abort, deadline).",
    ("finish_reason",),
    registry=REGISTRY,
)
REMOTE_PREFILL = Histogram(
    "llmserve_remote_prefill_seconds",
    "Decode pair of a disaggregated stack: from the call to a prefill pair until its first "
    "token arrived (the prefill pair's queue, the prefill and the KV transfer), by outcome: "
    "done, or fallback (failed or timed out; the request then prefilled here).",
    ("outcome",),
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
for _outcome in ("done", "fallback"):
    REMOTE_PREFILL.labels(_outcome)
DISAGG_TTFT = Histogram(
    "llmserve_disagg_ttft_seconds",
    "Decode pair of a disaggregated stack, per remotely prefilled request, its time to first "
    "token split by phase: prefill (the call to a prefill pair until its first token: that "
    "pair's queue and prefill), transfer (that first token until this pair's worker has the "
    "KV: the part of the push the prefill did not hide), first_decode (the KV in place until "
    "this pair's first decode step produced a token).",
    ("phase",),
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
for _phase in ("prefill", "transfer", "first_decode"):
    DISAGG_TTFT.labels(_phase)
KV_FETCHES = Counter(
    "llmserve_kv_fetches_total",
    "Requests whose routing named another pair holding more of their prefix (prefix fetch, "
    "docs/prefix-cache.md), by outcome: done (its KV came from that pair), fallback (the "
    "fetch failed or timed out; computed here), declined (computing measured cheaper than "
    "fetching).",
    ("outcome",),
    registry=REGISTRY,
)
for _outcome in ("done", "fallback", "declined"):
    KV_FETCHES.labels(_outcome)
KV_FETCH_SECONDS = Histogram(
    "llmserve_kv_fetch_seconds",
    "Prefix fetches that completed: from the call to the exporting pair until this pair's "
    "worker had the blocks.",
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
KV_EXPORTS = Counter(
    "llmserve_kv_exports_total",
    "ExportKv calls from other pairs fetching a prefix this pool holds, by outcome: sent (the "
    "worker copied the blocks out and pushes them), refused (no longer cached, a bad ask, or "
    "no worker).",
    ("outcome",),
    registry=REGISTRY,
)
for _outcome in ("sent", "refused"):
    KV_EXPORTS.labels(_outcome)
REJECTED = Counter(
    "llmserve_requests_rejected_total",
    "Requests refused before generating, by reason.",
    ("reason",),
    registry=REGISTRY,
)


def step_kind(plan: BatchPlan) -> str:
    """prefill, decode or mixed. A slice of one token counts as a decode (a one-token prompt
    chunk is rare and costs what a decode costs)."""
    num_decodes = sum(1 for n in plan.num_scheduled_tokens.values() if n == 1)
    if num_decodes == len(plan.num_scheduled_tokens):
        return "decode"
    return "prefill" if num_decodes == 0 else "mixed"


class _Delta:
    """Turns a running total kept by one Scheduler into increments. The loop builds a fresh
    Scheduler (totals back at 0) whenever the worker reconnects."""

    __slots__ = ("_last", "_owner")

    def __init__(self) -> None:
        self._owner: object = None
        self._last = 0

    def step(self, owner: object, total: int) -> int:
        if owner is not self._owner:
            self._owner, self._last = owner, 0
        delta, self._last = total - self._last, total
        return delta


_preemptions = _Delta()
_prefix_queried = _Delta()
_prefix_hits = _Delta()
_forked_block_refs = _Delta()
_block_copies = _Delta()
_granted_draft_tokens = _Delta()
_speculative_steps = _Delta()
_step_outcomes = {outcome: _Delta() for outcome in STEP_OUTCOMES}


def on_admitted(request: Request) -> None:
    PROMPT_TOKENS.inc(request.num_prompt_tokens)


def on_rejected(reason_or_error: str | BaseException) -> None:
    reason = (
        reason_or_error if isinstance(reason_or_error, str) else rejection_reason(reason_or_error)
    )
    REJECTED.labels(reason).inc()


def on_first_scheduled(queue_s: float | None) -> None:
    """Once per request, with its queue time (None: it never reached a step)."""
    if queue_s is not None:
        QUEUE_TIME.observe(queue_s)


def on_step(
    scheduler: Scheduler,
    plan: BatchPlan,
    events: Sequence[TokenEvent],
    step_s: float | None,
) -> None:
    """After update(): `step_s` is the worker round trip, None when no worker call was needed."""
    if step_s is not None and plan.num_scheduled_tokens:
        STEP_DURATION.labels(step_kind(plan)).observe(step_s)
    num_generated = 0
    for event in events:
        num_generated += len(event.new_token_ids)
        if event.finish_reason is not None:
            FINISHED.labels(event.finish_reason.value).inc()
    if num_generated:
        GENERATION_TOKENS.inc(num_generated)
    stats = scheduler.get_stats()
    RUNNING.set(stats.num_running)
    WAITING.set(stats.num_waiting)
    KV_BLOCKS_USED.set(stats.num_total_blocks - stats.num_free_blocks)
    KV_BLOCKS_TOTAL.set(stats.num_total_blocks)
    for counter, delta, total in (
        (PREEMPTIONS, _preemptions, stats.num_preemptions),
        (PREFIX_CACHE_QUERIED_TOKENS, _prefix_queried, stats.prefix_queried_tokens),
        (PREFIX_CACHE_HIT_TOKENS, _prefix_hits, stats.prefix_hit_tokens),
        (FORKED_BLOCK_REFS, _forked_block_refs, stats.num_forked_block_refs),
        (BLOCK_COPIES, _block_copies, stats.num_block_copies),
        (GRANTED_DRAFT_TOKENS, _granted_draft_tokens, stats.num_draft_tokens_granted),
        (SPECULATIVE_STEPS, _speculative_steps, stats.num_speculative_steps),
    ):
        increment = delta.step(scheduler, total)
        if increment > 0:
            counter.inc(increment)
    for outcome, total in scheduler.drafts.step_outcomes.items():
        increment = _step_outcomes[outcome].step(scheduler, total)
        if increment > 0:
            SPECULATION_STEPS.labels(outcome).inc(increment)


def on_drafts(result: StepResult) -> None:
    """Drafts proposed and accepted by proposer, and the tokens each speculating sequence
    emitted in the step."""
    for request_id, num_proposed in result.num_proposed_drafts.items():
        proposer = result.draft_proposers.get(request_id, "unknown")
        num_accepted = len(result.accepted_draft_ids.get(request_id, ()))
        DRAFT_TOKENS.labels(proposer).inc(num_proposed)
        if num_accepted:
            ACCEPTED_DRAFT_TOKENS.labels(proposer).inc(num_accepted)
        TOKENS_PER_STEP.observe(1 + num_accepted)
