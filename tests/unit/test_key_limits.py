"""Per-key limits' rules (services/tokenizer/access/limits.py): one-minute windows, leases that
expire unless refreshed, the refusal for each limit and the rate-limit headers. Time is
passed in."""

from __future__ import annotations

import pytest

from services.tokenizer.access.limits import (
    LEASE_TTL_S,
    WINDOW_S,
    KeyLimits,
    KeyOverLimitError,
    LocalCounters,
    Quota,
    WindowCounts,
    admitted_quota,
    duration_text,
    over_limit,
    window_index,
    window_reset_s,
)

START = window_index(1_000_000.0) * WINDOW_S
"""The start of a window."""


def admit(
    counters: LocalCounters,
    limits: KeyLimits,
    lease_id: str,
    now: float,
    num_prompt_tokens: int = 0,
    key_id: str = "k1",
) -> KeyOverLimitError | None:
    """What the limiter does: count, decide, take back a refused request's counts."""
    usage = counters.reserve(key_id, lease_id, num_prompt_tokens, now)
    refusal = over_limit(limits, usage)
    if refusal is not None:
        counters.unreserve(key_id, lease_id, num_prompt_tokens, usage)
    return refusal


def test_windows_are_whole_minutes() -> None:
    assert window_index(START) == window_index(START + 59.999)
    assert window_index(START + 60) == window_index(START) + 1
    assert window_reset_s(START) == 60
    assert window_reset_s(START + 45) == pytest.approx(15)


def test_unlimited() -> None:
    assert KeyLimits().unlimited
    assert not KeyLimits(rpm=1).unlimited
    assert not KeyLimits(max_concurrent=1).unlimited
    assert not KeyLimits(tpm=1).unlimited


# ---- rpm -----------------------------------------------------------------------------------


def test_rpm_refuses_the_request_past_the_limit_until_the_next_window() -> None:
    counters, limits = LocalCounters(), KeyLimits(rpm=2)
    assert admit(counters, limits, "a", START + 1) is None
    assert admit(counters, limits, "b", START + 2) is None
    refusal = admit(counters, limits, "c", START + 50)
    assert refusal is not None and refusal.limit == "rpm"
    assert refusal.retry_after_ms == 10_000
    assert "rpm (2 requests per minute)" in str(refusal)
    # A refused request does not count: still refused in this window, not more so.
    assert admit(counters, limits, "d", START + 55) is not None
    assert admit(counters, limits, "e", START + 60) is None  # a new window


def test_a_refused_request_takes_back_its_counts() -> None:
    counters = LocalCounters()
    usage = counters.reserve("k1", "a", 7, START)
    counters.unreserve("k1", "a", 7, usage)
    again = counters.reserve("k1", "b", 0, START)
    assert (again.num_requests, again.num_tokens_before, again.num_in_flight) == (1, 0, 1)


def test_keys_count_apart() -> None:
    counters, limits = LocalCounters(), KeyLimits(rpm=1)
    assert admit(counters, limits, "a", START, key_id="k1") is None
    assert admit(counters, limits, "b", START, key_id="k2") is None
    assert admit(counters, limits, "c", START, key_id="k1") is not None


# ---- tpm -----------------------------------------------------------------------------------


def test_tpm_counts_prompt_and_output_tokens_and_admits_while_under() -> None:
    counters, limits = LocalCounters(), KeyLimits(tpm=100)
    # Under the limit at that moment: admitted, though its prompt takes the key over it.
    assert admit(counters, limits, "a", START, num_prompt_tokens=60) is None
    assert admit(counters, limits, "b", START + 1, num_prompt_tokens=60) is None
    refusal = admit(counters, limits, "c", START + 2, num_prompt_tokens=1)
    assert refusal is not None and refusal.limit == "tpm"
    assert refusal.quota.num_tokens == 120


def test_tpm_output_tokens_count_in_the_window_they_are_generated_in() -> None:
    counters, limits = LocalCounters(), KeyLimits(tpm=50)
    assert admit(counters, limits, "a", START + 58, num_prompt_tokens=10) is None
    counters.add_tokens("k1", 45, START + 59)
    assert admit(counters, limits, "b", START + 59.5) is not None  # 55 >= 50
    counters.add_tokens("k1", 45, START + 61)  # the next window
    assert admit(counters, limits, "c", START + 62) is None  # 45 < 50
    assert admit(counters, limits, "d", START + 63) is None
    counters.add_tokens("k1", 5, START + 64)
    assert admit(counters, limits, "e", START + 65) is not None


# ---- max_concurrent ------------------------------------------------------------------------


def test_max_concurrent_refuses_until_a_lease_is_released() -> None:
    counters, limits = LocalCounters(), KeyLimits(max_concurrent=2)
    assert admit(counters, limits, "a", START) is None
    assert admit(counters, limits, "b", START) is None
    refusal = admit(counters, limits, "c", START + 1)
    assert refusal is not None and refusal.limit == "max_concurrent"
    assert refusal.retry_after_ms == 1000
    assert counters.num_in_flight("k1", START + 1) == 2
    counters.release("k1", "a")
    assert admit(counters, limits, "d", START + 2) is None


def test_a_lease_not_refreshed_expires_and_a_refreshed_one_lives() -> None:
    counters, limits = LocalCounters(), KeyLimits(max_concurrent=2)
    assert admit(counters, limits, "a", START) is None
    assert admit(counters, limits, "b", START) is None
    # "a" is refreshed (its replica streams on); "b"'s replica died.
    counters.refresh("k1", "a", START + LEASE_TTL_S - 1)
    assert admit(counters, limits, "c", START + LEASE_TTL_S - 0.5) is not None
    assert counters.num_in_flight("k1", START + LEASE_TTL_S) == 1
    assert admit(counters, limits, "c", START + LEASE_TTL_S) is None
    assert admit(counters, limits, "d", START + LEASE_TTL_S + 1) is not None


def test_refreshing_or_releasing_an_unknown_lease_is_harmless() -> None:
    counters = LocalCounters()
    counters.refresh("k1", "nope", START)
    counters.release("k1", "nope")
    counters.reserve("k1", "a", 0, START)
    counters.refresh("k1", "gone", START)
    assert counters.num_in_flight("k1", START) == 1


# ---- refusals and headers ------------------------------------------------------------------


def usage(
    num_requests: int = 1, num_tokens_before: int = 0, num_in_flight: int = 1, reset_s: float = 30
) -> WindowCounts:
    return WindowCounts(0, num_requests, num_tokens_before, num_in_flight, reset_s)


def test_max_concurrent_is_checked_first_then_rpm_then_tpm() -> None:
    limits = KeyLimits(max_concurrent=1, rpm=1, tpm=1)
    everything = usage(num_requests=2, num_tokens_before=5, num_in_flight=2)
    checks = [
        (everything, "max_concurrent"),
        (usage(num_requests=2, num_tokens_before=5), "rpm"),
        (usage(num_tokens_before=5), "tpm"),
    ]
    for used, limit in checks:
        refusal = over_limit(limits, used)
        assert refusal is not None and refusal.limit == limit
        assert limit in str(refusal)
    assert over_limit(limits, usage()) is None


def test_the_retry_hint_is_the_window_reset_rounded_up() -> None:
    refusal = over_limit(KeyLimits(rpm=1), usage(num_requests=2, reset_s=12.3456))
    assert refusal is not None
    assert refusal.retry_after_ms == 12_346
    assert "retry in 13 s" in str(refusal)


def test_headers_for_the_limits_the_key_has() -> None:
    assert Quota(KeyLimits(max_concurrent=3), 1, 1, 30).headers() == {}
    assert Quota(KeyLimits(rpm=10), 4, 99, 30).headers() == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "6",
        "x-ratelimit-reset-requests": "30s",
    }
    both = Quota(KeyLimits(rpm=10, tpm=100), 12, 150, 0.25).headers()
    assert both["x-ratelimit-remaining-requests"] == "0"  # never negative
    assert both["x-ratelimit-limit-tokens"] == "100"
    assert both["x-ratelimit-remaining-tokens"] == "0"
    assert both["x-ratelimit-reset-tokens"] == "250ms"


def test_an_admitted_quota_counts_the_request_and_its_prompt() -> None:
    quota = admitted_quota(
        KeyLimits(rpm=5, tpm=100), usage(num_requests=2, num_tokens_before=30), 7
    )
    assert (quota.num_requests, quota.num_tokens) == (2, 37)
    refused = over_limit(KeyLimits(rpm=1), usage(num_requests=2, num_tokens_before=30))
    assert refused is not None
    assert (refused.quota.num_requests, refused.quota.num_tokens) == (1, 30)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0001, "1ms"), (0.25, "250ms"), (0.9994, "1s"), (1.0, "1s"), (12.3, "13s"),
     (59.5, "1m0s"), (60.0, "1m0s"), (61.0, "1m1s")],
)  # fmt: skip
def test_duration_text(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text
