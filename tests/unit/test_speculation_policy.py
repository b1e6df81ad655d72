"""The speculation back-off policy: drafts where verifying them is nearly free (one sequence,
a memory-bound step), none where each token costs its full share (a large batch), more for
sequences whose drafts are accepted, and a cost line that recovers the step's cost."""

from __future__ import annotations

import random

import pytest

from services.scheduler.features.speculation_policy import (
    MIN_DRAFT_VALUE,
    PROBE_INTERVAL,
    SpeculationPolicy,
    StepCostModel,
)


def trained(fixed_s: float, per_token_s: float, max_draft_tokens: int = 4) -> SpeculationPolicy:
    """A policy that has seen steps of 1..64 tokens costing fixed + per_token * tokens."""
    policy = SpeculationPolicy(max_draft_tokens)
    for tokens in range(1, 65):
        policy.observe_step(tokens, fixed_s + per_token_s * tokens)
    return policy


def test_the_cost_line_is_recovered_from_noisy_steps() -> None:
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(500):
        tokens = rng.randint(1, 200)
        model.observe(tokens, (0.015 + 0.0004 * tokens) * rng.uniform(0.95, 1.05))
    line = model.line()
    assert line is not None
    assert line[0] == pytest.approx(0.015, rel=0.15)
    assert line[1] == pytest.approx(0.0004, rel=0.1)


def test_no_steps_seen_means_no_drafts() -> None:
    assert SpeculationPolicy(4).draft_slots(["a"]) == {}
    assert StepCostModel().line() is None


def test_steps_of_one_size_fall_back_to_the_prior_slope() -> None:
    policy = SpeculationPolicy(4)
    for _ in range(10):
        policy.observe_step(1, 0.020)
    line = policy.cost.line()
    assert line is not None and 0 < line[1] < 0.1 * line[0]
    assert policy.draft_slots(["a"]) == {"a": 4}  # a memory-bound guess: drafts pay


def test_one_user_on_a_memory_bound_step_drafts_fully() -> None:
    policy = trained(fixed_s=0.015, per_token_s=0.0003)
    assert policy.draft_slots(["a"]) == {"a": 4}


def test_a_large_compute_bound_batch_does_not_draft() -> None:
    # 32 sequences at 4 ms per token: a draft accepted half the time never pays.
    policy = trained(fixed_s=0.015, per_token_s=0.004)
    batch = [f"r{i}" for i in range(32)]
    assert policy.draft_slots(batch) == {}


def test_sequences_that_accept_get_more_drafts_than_those_that_do_not() -> None:
    policy = trained(fixed_s=0.015, per_token_s=0.0015)
    for _ in range(10):
        policy.observe_drafts("copying", proposed=4, accepted=4)
        policy.observe_drafts("chatting", proposed=4, accepted=0)
    batch = ["copying", "chatting", *[f"r{i}" for i in range(6)]]
    slots = policy.draft_slots(batch)
    assert slots.get("copying", 0) == 4
    assert slots.get("chatting", 0) == 0


def test_acceptance_drifts_with_what_is_observed_and_is_forgotten() -> None:
    policy = SpeculationPolicy(4)
    assert policy.acceptance("a") == pytest.approx(0.5)
    for _ in range(30):
        policy.observe_drafts("a", proposed=2, accepted=0)
    assert policy.acceptance("a") < 0.1
    policy.forget("a")
    assert policy.acceptance("a") < 0.1  # the batch-wide share it now starts from
    policy.observe_drafts("b", proposed=0, accepted=0)  # nothing verified: nothing learnt
    assert "b" not in policy._sequences


def test_a_step_long_anyway_makes_drafts_relatively_cheaper() -> None:
    # A 512-token prefill chunk in the step: a draft's extra token adds a smaller share to a
    # step that is long anyway, so more drafts pay than in a bare decode step.
    policy = trained(fixed_s=0.010, per_token_s=0.0005)
    alone = sum(policy.draft_slots(["a", "b"]).values())
    with_prefill = sum(policy.draft_slots(["a", "b"], other_tokens=512).values())
    assert with_prefill > alone


def test_never_more_than_the_maximum() -> None:
    policy = trained(fixed_s=0.015, per_token_s=0.0, max_draft_tokens=3)
    for _ in range(20):
        policy.observe_drafts("a", proposed=3, accepted=3)
    assert policy.draft_slots(["a", "b"]) == {"a": 3, "b": 3}
    assert SpeculationPolicy(0).draft_slots(["a"]) == {}


def test_caps_bound_each_sequence_below_the_maximum() -> None:
    policy = SpeculationPolicy(8)
    for _ in range(20):
        policy.observe_step(1, 0.010)
        policy.observe_step(6, 0.0102)
    slots = policy.draft_slots(["a", "b", "c"], caps={"a": 2, "b": 0, "c": 8})
    assert slots.get("a", 0) <= 2
    assert "b" not in slots
    assert slots["c"] > 2


def failing_run(policy: SpeculationPolicy, batch: list[str], num_steps: int) -> list[int]:
    """Slots granted to batch[0] at each step, every draft of the batch rejected."""
    granted = []
    for _ in range(num_steps):
        slots = policy.draft_slots(batch)
        for request_id, num_slots in slots.items():
            policy.observe_drafts(request_id, proposed=num_slots, accepted=0)
        granted.append(slots.get(batch[0], 0))
    return granted


@pytest.mark.parametrize("per_token_s", [0.0003, 0.00001], ids=["2%", "nearly free"])
def test_drafts_that_keep_failing_stop_within_three_steps_and_are_probed_rarely(
    per_token_s: float,
) -> None:
    """Plain chat: the prior (0.5) grants the first step its drafts, the misses end them by
    the third step even where a draft token costs almost nothing, and then one draft is
    tried every PROBE_INTERVAL decodes."""
    policy = trained(fixed_s=0.015, per_token_s=per_token_s)
    granted = failing_run(policy, ["a"], 3 * PROBE_INTERVAL)
    assert granted[0] == 4
    assert granted[2:PROBE_INTERVAL] == [0] * (PROBE_INTERVAL - 2)
    # Its decodes 1..PROBE_INTERVAL since the first grant were not granted; the last probes.
    probes = [step for step, n in enumerate(granted) if step >= 2 and n]
    assert probes == [PROBE_INTERVAL, 2 * PROBE_INTERVAL]
    assert all(granted[step] == 1 for step in probes)


def test_a_probe_that_is_accepted_brings_the_drafts_back() -> None:
    policy = trained(fixed_s=0.015, per_token_s=0.0003)
    failing_run(policy, ["a"], PROBE_INTERVAL)
    assert policy.draft_slots(["a"]) == {"a": 1}  # the probe
    policy.observe_drafts("a", proposed=1, accepted=1)
    for _ in range(6):
        num_slots = policy.draft_slots(["a"]).get("a", 0)
        assert num_slots > 0
        policy.observe_drafts("a", proposed=num_slots, accepted=num_slots)
    assert policy.draft_slots(["a"]) == {"a": 4}


def test_a_compute_bound_batch_is_never_probed() -> None:
    policy = trained(fixed_s=0.015, per_token_s=0.004)
    batch = [f"r{i}" for i in range(32)]
    assert policy.is_compute_bound(len(batch))
    assert not trained(fixed_s=0.015, per_token_s=0.0003).is_compute_bound(1)
    for _ in range(3 * PROBE_INTERVAL):
        assert policy.draft_slots(batch) == {}


def test_new_sequences_in_a_batch_whose_drafts_fail_start_low() -> None:
    """Acceptance starts from the batch-wide share: after a run of failing sequences a new
    one is not granted drafts at once (it is probed later)."""
    policy = trained(fixed_s=0.015, per_token_s=0.0003)
    granted = [sum(failing_run(policy, [f"c{i}"], 1)) for i in range(20)]
    assert granted[0] == 4
    assert granted[-10:] == [0] * 10
    assert policy.acceptance("new") < MIN_DRAFT_VALUE


def test_prefill_steps_do_not_flatten_the_decode_line() -> None:
    """Four users on a compute-bound machine: a decode row costs 1.8 ms, a prompt token
    0.3 ms (large tiles, causal attention). Steps with prefill chunks among the decode steps
    must not pull the line's slope down to the prompt tokens' cost: drafts accepted 89 % of
    the time do not pay at 1.8 ms a row, and the step with prefill is priced by its own rate."""
    fixed, per_row, per_prompt_token = 0.0002, 0.0018, 0.0003
    policy = SpeculationPolicy(3)
    for step in range(200):
        rows = 4 + step % 13  # 4 decodes and 0..12 drafts
        policy.observe_step(rows, fixed + per_row * rows)
        if step % 10 == 0:  # a new request's 128-token prompt beside 4 decodes
            policy.observe_step(4, fixed + per_row * 4 + per_prompt_token * 128, 128)
    for index in range(4):
        policy.observe_drafts(str(index), proposed=100, accepted=89)
    line = policy.cost.line()
    assert line is not None and line[1] == pytest.approx(per_row, rel=0.01)
    assert policy.prefill_cost.per_token(0.0) == pytest.approx(per_prompt_token, rel=0.01)
    assert policy.draft_slots(["0", "1", "2", "3"]) == {}
    assert policy.is_compute_bound(4)
