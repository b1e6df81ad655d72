"""Per-key limits (key file `max_concurrent=N`, `rpm=N`, `tpm=N`): the counting rules, pure.
Time is passed in (wall-clock seconds: replicas sharing counts in Redis agree on the minute).

    rpm, tpm         fixed one-minute windows (index = now // 60): a request counts in the
                     window it arrives in; tokens = prompt tokens at admission + output tokens
                     as they stream. A request is admitted while the key is under its tpm at
                     that moment (as OpenAI does), so one long answer may overshoot it.
    max_concurrent   leases, one per admitted request, each with an expiry that its replica
                     pushes back while the request streams (LEASE_TTL_S): a replica that dies
                     holding leases frees them when they expire, never leaks them.

Admission counts first and decides after (`over_limit` on the usage that includes the request),
then takes a refused request's counts back: two replicas admitting at once both see each
other, so neither goes over (at worst both are refused). key_limiter.py is the shell: Redis
when the tier has it, else `LocalCounters`, the same rules in this process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.contracts.errors import RateLimitedError

WINDOW_S = 60
"""Length of an rpm / tpm window."""
LEASE_TTL_S = 30.0
"""A lease not refreshed for this long is gone: the most a dead replica's requests keep
counting against max_concurrent."""
LEASE_REFRESH_S = 10.0
"""How often a replica pushes back the expiry of the leases of its running requests."""
CONCURRENCY_RETRY_S = 1.0
"""The retry hint of a request refused for max_concurrent (when a stream ends is unknown)."""

LIMIT_NAMES = ("max_concurrent", "rpm", "tpm")


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """An API key's limits from the key file; None = unlimited."""

    max_concurrent: int | None = None
    """Requests (streams included) in flight at once."""
    rpm: int | None = None
    """Requests per minute."""
    tpm: int | None = None
    """Tokens per minute: prompt tokens plus output tokens."""

    @property
    def unlimited(self) -> bool:
        return self.max_concurrent is None and self.rpm is None and self.tpm is None


UNLIMITED = KeyLimits()


def window_index(now: float) -> int:
    """The one-minute window `now` falls in."""
    return int(now // WINDOW_S)


def window_reset_s(now: float) -> float:
    """Seconds until the window `now` falls in ends (the counts start again from zero)."""
    return (window_index(now) + 1) * WINDOW_S - now


@dataclass(frozen=True, slots=True)
class WindowCounts:
    """A key's counts as one request is admitted, that request's share included."""

    window: int
    """The window the request counted in."""
    num_requests: int
    """Requests in the window, this one included."""
    num_tokens_before: int
    """Tokens in the window before this request's prompt."""
    num_in_flight: int
    """Live leases, this request's included."""
    reset_s: float
    """Seconds until the window ends."""


@dataclass(frozen=True, slots=True)
class Quota:
    """What a response tells the client about its key's rpm and tpm (the headers)."""

    limits: KeyLimits
    num_requests: int
    num_tokens: int
    reset_s: float

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers, for the limits the key has."""
        headers: dict[str, str] = {}
        reset = duration_text(self.reset_s)
        if self.limits.rpm is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limits.rpm)
            remaining = max(0, self.limits.rpm - self.num_requests)
            headers["x-ratelimit-remaining-requests"] = str(remaining)
            headers["x-ratelimit-reset-requests"] = reset
        if self.limits.tpm is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limits.tpm)
            remaining = max(0, self.limits.tpm - self.num_tokens)
            headers["x-ratelimit-remaining-tokens"] = str(remaining)
            headers["x-ratelimit-reset-tokens"] = reset
        return headers


def duration_text(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: `250ms`, `12s`, `1m0s`."""
    milliseconds = math.ceil(seconds * 1000)
    if milliseconds < 1000:
        return f"{milliseconds}ms"
    whole_s = math.ceil(milliseconds / 1000)
    minutes, rest_s = divmod(whole_s, 60)
    return f"{minutes}m{rest_s}s" if minutes else f"{rest_s}s"


def admitted_quota(limits: KeyLimits, usage: WindowCounts, num_prompt_tokens: int) -> Quota:
    return Quota(
        limits, usage.num_requests, usage.num_tokens_before + num_prompt_tokens, usage.reset_s
    )


class KeyOverLimitError(RateLimitedError):
    """A request refused for its key's limit; `quota` is what the key had used (the request
    not counted)."""

    def __init__(self, limit: str, message: str, retry_after_s: float, quota: Quota) -> None:
        super().__init__(limit, message, max(1, math.ceil(retry_after_s * 1000)))
        self.quota = quota


def over_limit(limits: KeyLimits, usage: WindowCounts) -> KeyOverLimitError | None:
    """The refusal for a request whose admission brought its key to `usage`; None = admit.
    max_concurrent is checked first: its refusal asks for the shortest wait."""
    quota = Quota(limits, usage.num_requests - 1, usage.num_tokens_before, usage.reset_s)
    retry = f"retry in {math.ceil(usage.reset_s)} s"
    if limits.max_concurrent is not None and usage.num_in_flight > limits.max_concurrent:
        return KeyOverLimitError(
            "max_concurrent",
            f"rate limit: this API key already has {limits.max_concurrent} requests in "
            "flight, its max_concurrent; retry when one ends",
            CONCURRENCY_RETRY_S,
            quota,
        )
    if limits.rpm is not None and usage.num_requests > limits.rpm:
        return KeyOverLimitError(
            "rpm",
            f"rate limit: this API key's rpm ({limits.rpm} requests per minute) is used up; "
            + retry,
            usage.reset_s,
            quota,
        )
    if limits.tpm is not None and usage.num_tokens_before >= limits.tpm:
        return KeyOverLimitError(
            "tpm",
            f"rate limit: this API key's tpm ({limits.tpm} tokens per minute) is used up; " + retry,
            usage.reset_s,
            quota,
        )
    return None


@dataclass(slots=True)
class _Window:
    index: int
    num_requests: int = 0
    num_tokens: int = 0


@dataclass(slots=True)
class _KeyCounts:
    window: _Window
    leases: dict[str, float] = field(default_factory=dict)
    """Lease id -> expiry (insertion-ordered)."""

    def current(self, now: float) -> _Window:
        index = window_index(now)
        if self.window.index != index:
            self.window = _Window(index)
        return self.window


class LocalCounters:
    """The counts of one process: what a single replica (no Redis) enforces, and what a
    replica falls back to while Redis does not answer. Same rules as the Redis store."""

    def __init__(self) -> None:
        self._keys: dict[str, _KeyCounts] = {}

    def _counts(self, key_id: str, now: float) -> _KeyCounts:
        counts = self._keys.get(key_id)
        if counts is None:
            counts = self._keys[key_id] = _KeyCounts(_Window(window_index(now)))
        return counts

    def reserve(
        self, key_id: str, lease_id: str, num_prompt_tokens: int, now: float
    ) -> WindowCounts:
        """Count a request (a lease, a request, its prompt tokens) and return the usage that
        includes it."""
        counts = self._counts(key_id, now)
        counts.leases = {lease: expiry for lease, expiry in counts.leases.items() if expiry > now}
        counts.leases[lease_id] = now + LEASE_TTL_S
        window = counts.current(now)
        window.num_requests += 1
        num_tokens_before = window.num_tokens
        window.num_tokens += num_prompt_tokens
        return WindowCounts(
            window.index,
            window.num_requests,
            num_tokens_before,
            len(counts.leases),
            window_reset_s(now),
        )

    def unreserve(
        self, key_id: str, lease_id: str, num_prompt_tokens: int, usage: WindowCounts
    ) -> None:
        """Take back what `reserve` counted for a refused request."""
        counts = self._keys[key_id]
        counts.leases.pop(lease_id, None)
        if counts.window.index == usage.window:
            counts.window.num_requests -= 1
            counts.window.num_tokens -= num_prompt_tokens

    def add_tokens(self, key_id: str, num_tokens: int, now: float) -> None:
        """Output tokens, in the window they were generated in."""
        self._counts(key_id, now).current(now).num_tokens += num_tokens

    def refresh(self, key_id: str, lease_id: str, now: float) -> None:
        counts = self._keys.get(key_id)
        if counts is not None and lease_id in counts.leases:
            counts.leases[lease_id] = now + LEASE_TTL_S

    def release(self, key_id: str, lease_id: str) -> None:
        counts = self._keys.get(key_id)
        if counts is not None:
            counts.leases.pop(lease_id, None)

    def num_in_flight(self, key_id: str, now: float) -> int:
        counts = self._keys.get(key_id)
        if counts is None:
            return 0
        return sum(expiry > now for expiry in counts.leases.values())
