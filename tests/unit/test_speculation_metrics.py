"""Speculation in the scheduler's metrics, driven by the fake worker: draft tokens granted,
proposed and accepted (by proposer), and each decode step's outcome: drafted, or why it
drafted nothing (off, compute-bound, low acceptance, no proposals)."""

from __future__ import annotations

from collections.abc import Callable

from services.contracts.step import BatchPlan, StepResult
from services.scheduler import metrics
from tests.unit.factories import FakeWorker, create_requests, create_scheduler
from tests.unit.test_overlapped_scheduling import position_sampler
from tests.unit.test_scheduler_speculation import guesser

StepSeconds = Callable[[BatchPlan, StepResult], float]


def memory_bound(plan: BatchPlan, result: StepResult) -> float:
    """10 ms a step, 0.1 ms a token: drafts are nearly free."""
    return 0.010 + 0.0001 * (
        plan.total_num_scheduled_tokens + sum(result.num_proposed_drafts.values())
    )


def compute_bound(plan: BatchPlan, result: StepResult) -> float:
    """Every token costs as much as the step's fixed part: drafts never pay."""
    return 0.010 * (1 + plan.total_num_scheduled_tokens + sum(result.num_proposed_drafts.values()))


def value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def outcome(name: str) -> float:
    return value("llmserve_spec_decode_steps_total", outcome=name)


def snapshot() -> dict[str, float]:
    names = {
        "granted": ("llmserve_spec_decode_granted_tokens_total", {}),
        "proposed": ("llmserve_spec_decode_draft_tokens_total", {"proposer": "ngram"}),
        "accepted": ("llmserve_spec_decode_accepted_tokens_total", {"proposer": "ngram"}),
    }
    taken = {key: value(name, **labels) for key, (name, labels) in names.items()}
    for name in ("drafted", "off", "compute_bound", "low_acceptance", "no_proposals"):
        taken[name] = outcome(name)
    return taken


def serve(
    guess: Callable[[Callable[[str, int], int]], Callable[[str, int], int] | None],
    step_seconds: StepSeconds,
    num_requests: int = 1,
    **config: object,
) -> dict[str, float]:
    """Serve requests to the end through the metrics hooks; the metrics' increments."""
    before = snapshot()
    sample = position_sampler(eos_every=10**9)
    worker = FakeWorker(sample=sample, guess=guess(sample))
    scheduler = create_scheduler(**config)
    for request in create_requests(num_requests, num_tokens=20, max_new_tokens=60):
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule(now=0.0)
        result = worker.step(plan)
        scheduler.observe_step(plan, result, step_seconds(plan, result))
        events = scheduler.update(plan, result, now=0.0)
        metrics.on_step(scheduler, plan, events, 0.01)
        metrics.on_drafts(result)
    after = snapshot()
    return {key: after[key] - before[key] for key in after}


def test_drafts_that_pay_are_granted_proposed_and_accepted() -> None:
    seen = serve(lambda sample: sample, memory_bound)
    assert seen["granted"] >= seen["proposed"] > 0
    assert seen["accepted"] == seen["proposed"]  # the guesser is always right
    assert seen["drafted"] > 0
    assert seen["off"] == seen["compute_bound"] == seen["no_proposals"] == 0


def test_no_speculation_counts_every_decode_step_as_off() -> None:
    seen = serve(lambda sample: sample, memory_bound, speculation=False)
    assert seen["off"] >= 59  # 60 tokens: the prefill's, then 59 decode steps at least
    assert seen["granted"] == seen["proposed"] == seen["drafted"] == 0


def test_a_compute_bound_batch_says_so() -> None:
    # Drafts right 3 times in 4: worth it at one user, not where a token costs a step's share.
    seen = serve(guesser, compute_bound, num_requests=16)
    assert seen["compute_bound"] > 0.8 * (seen["compute_bound"] + seen["drafted"])
    assert seen["low_acceptance"] == 0


def test_drafts_that_always_miss_stop_for_low_acceptance() -> None:
    seen = serve(lambda sample: lambda request_id, position: 999_999, memory_bound)
    assert seen["accepted"] == 0
    # The first steps draft and miss; then the policy stops, probing now and then.
    assert seen["low_acceptance"] > 3 * seen["drafted"] > 0


def test_slots_without_a_guess_are_no_proposals() -> None:
    seen = serve(lambda sample: None, memory_bound)
    assert seen["granted"] > 0
    assert seen["proposed"] == seen["drafted"] == 0
    assert seen["no_proposals"] > 0
