"""Role-aware routing (services/tokenizer/routing/disaggregation.py): which requests go through a
prefill pair, and which one."""

from __future__ import annotations

from services.contracts.sampling_params import SamplingParams
from services.tokenizer.routing.disaggregation import (
    PrefillCandidate,
    choose_prefill,
    takes_requests,
    wants_remote_prefill,
)
from services.tokenizer.routing.policy import SchedulerLoad

GREEDY = SamplingParams(temperature=0.0)


def test_prefill_pairs_take_no_requests_and_unknown_roles_stay_candidates() -> None:
    assert not takes_requests("prefill")
    assert takes_requests("decode") and takes_requests("both") and takes_requests(None)


def test_only_long_single_choice_prompts_use_a_prefill_pair() -> None:
    assert wants_remote_prefill(512, GREEDY, 512)
    assert not wants_remote_prefill(511, GREEDY, 512)
    assert not wants_remote_prefill(600, SamplingParams(n=2), 512)
    assert not wants_remote_prefill(600, SamplingParams(logprobs=2), 512)


def test_the_least_loaded_answering_prefill_pair_is_chosen() -> None:
    candidates = [
        PrefillCandidate("decode:1", "decode", SchedulerLoad(0, 0)),
        PrefillCandidate("busy:1", "prefill", SchedulerLoad(3, 1)),
        PrefillCandidate("down:1", None, None),
        PrefillCandidate("idle:1", "prefill", SchedulerLoad(1, 0)),
    ]
    assert choose_prefill(candidates) == "idle:1"


def test_ties_take_turns_and_no_answering_prefill_pair_means_none() -> None:
    tied = [
        PrefillCandidate("a:1", "prefill", SchedulerLoad(0, 0)),
        PrefillCandidate("b:1", "prefill", SchedulerLoad(0, 0)),
    ]
    assert [choose_prefill(tied, turn) for turn in range(3)] == ["a:1", "b:1", "a:1"]
    assert choose_prefill([PrefillCandidate("a:1", "prefill", None)]) is None
    assert choose_prefill([PrefillCandidate("d:1", "decode", SchedulerLoad(0, 0))]) is None
