"""The routing policy: longest cached prefix unless overloaded, else least loaded."""

from __future__ import annotations

import pytest

from services.tokenizer.routing.policy import Candidate, SchedulerLoad, choose_scheduler


def load(running: int = 0, waiting: int = 0, sent: int = 0) -> SchedulerLoad:
    return SchedulerLoad(running, waiting, sent)


def test_round_robin_ignores_cache_and_load() -> None:
    candidates = [Candidate(10, load(50)), Candidate(0, load(0)), Candidate(0, None)]
    picks = [
        choose_scheduler(candidates, "round_robin", turn=t, overload_queued=4) for t in range(6)
    ]
    assert picks == [0, 1, 2, 0, 1, 2]


def test_cache_aware_prefers_the_longest_cached_prefix_even_when_busier() -> None:
    candidates = [Candidate(2, load(1)), Candidate(7, load(5, waiting=2)), Candidate(0, load(0))]
    assert choose_scheduler(candidates, "cache_aware", turn=0, overload_queued=4) == 1


def test_overloaded_holder_loses_to_the_least_loaded() -> None:
    candidates = [
        Candidate(9, load(8, waiting=3, sent=1)),
        Candidate(0, load(2)),
        Candidate(0, load(1)),
    ]
    assert choose_scheduler(candidates, "cache_aware", turn=0, overload_queued=4) == 2


def test_among_equal_holders_the_less_loaded_wins() -> None:
    candidates = [Candidate(5, load(4)), Candidate(5, load(1)), Candidate(0, load(0))]
    assert choose_scheduler(candidates, "cache_aware", turn=0, overload_queued=4) == 1


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded"])
def test_no_cache_means_least_loaded_and_ties_rotate(policy: str) -> None:
    candidates = [Candidate(0, load(3)), Candidate(0, load(1)), Candidate(0, load(1))]
    picks = {choose_scheduler(candidates, policy, turn=t, overload_queued=4) for t in range(4)}  # type: ignore[arg-type]
    assert picks == {1, 2}


def test_requests_sent_since_the_last_poll_count_as_load() -> None:
    candidates = [Candidate(0, load(1, sent=3)), Candidate(0, load(2))]
    assert choose_scheduler(candidates, "least_loaded", turn=0, overload_queued=4) == 1


def test_a_scheduler_without_stats_is_the_last_resort() -> None:
    candidates = [Candidate(9, None), Candidate(0, load(40))]
    assert choose_scheduler(candidates, "cache_aware", turn=0, overload_queued=4) == 1
    everyone_down = [Candidate(0, None), Candidate(3, None)]
    assert choose_scheduler(everyone_down, "cache_aware", turn=0, overload_queued=4) == 1
    with pytest.raises(ValueError):
        choose_scheduler([], "cache_aware", turn=0, overload_queued=4)


def test_recent_routes_follow_the_longest_shared_run_of_one_scheduler() -> None:
    from services.tokenizer.routing.policy import RecentRoutes

    recent = RecentRoutes(capacity=4)
    both, only_a = ["a:1", "b:1"], ["a:1"]
    assert recent.leading_blocks([], both) == [0, 0]
    recent.remember([b"a", b"b", b"c"], "b:1")
    assert recent.leading_blocks([b"a", b"b", b"x"], both) == [0, 2]
    assert recent.leading_blocks([b"x", b"b"], both) == [0, 0]  # the run starts at block one
    recent.remember([b"a", b"d"], "a:1")  # re-routed: the first block now points elsewhere
    assert recent.leading_blocks([b"a", b"b"], both) == [1, 0]
    recent.remember([b"e"], "b:1")  # capacity 4: the least recently used hash (b"b") goes
    assert recent.leading_blocks([b"b"], both) == [0, 0]
    assert recent.leading_blocks([b"a"], only_a) == [1]
    assert recent.leading_blocks([b"e"], only_a) == [0]  # a scheduler not listed counts not
    # Places shift when schedulers join or leave: the owner is found by address.
    assert recent.leading_blocks([b"e"], ["c:1", "b:1"]) == [0, 1]


# ---- LoRA adapters: only holders, active ones first --------------------------------------


def test_an_adapter_request_goes_only_to_schedulers_holding_it() -> None:
    candidates = [
        Candidate(9, load(0), "missing"),
        Candidate(0, load(5), "loaded"),
        Candidate(0, None, "missing"),
    ]
    for policy in ("cache_aware", "least_loaded", "round_robin"):
        picks = {
            choose_scheduler(candidates, policy, turn=t, overload_queued=4)  # type: ignore[arg-type]
            for t in range(4)
        }
        assert picks == {1}, policy
    with pytest.raises(ValueError):
        choose_scheduler(
            [Candidate(0, load(0), "missing")], "least_loaded", turn=0, overload_queued=4
        )


def test_where_the_adapter_is_active_wins_over_load_and_cached_prefix() -> None:
    candidates = [
        Candidate(8, load(0), "loaded"),
        Candidate(0, load(3, waiting=1), "active"),
        Candidate(0, load(1), "loaded"),
    ]
    assert choose_scheduler(candidates, "cache_aware", turn=0, overload_queued=4) == 1
    assert choose_scheduler(candidates, "least_loaded", turn=0, overload_queued=4) == 1


def test_among_active_schedulers_the_policy_decides() -> None:
    candidates = [
        Candidate(0, load(2), "active"),
        Candidate(6, load(3), "active"),
        Candidate(9, load(0), "loaded"),
    ]
    assert choose_scheduler(candidates, "cache_aware", turn=0, overload_queued=4) == 1
    assert choose_scheduler(candidates, "least_loaded", turn=0, overload_queued=4) == 0


def test_an_overloaded_active_scheduler_loses_to_one_that_would_load_the_adapter() -> None:
    candidates = [Candidate(0, load(2, waiting=4), "active"), Candidate(0, load(3), "loaded")]
    assert choose_scheduler(candidates, "least_loaded", turn=0, overload_queued=4) == 1


def test_round_robin_ignores_where_the_adapter_is_active() -> None:
    candidates = [Candidate(0, load(0), "active"), Candidate(0, load(9), "loaded")]
    picks = [
        choose_scheduler(candidates, "round_robin", turn=t, overload_queued=4) for t in range(4)
    ]
    assert picks == [0, 1, 0, 1]
