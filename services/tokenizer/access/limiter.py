"""Per-key limits enforced across the tier: the counts live in Redis when the tier has it, so
the replicas behind one port see one count per key; without Redis (one replica), or while
Redis does not answer, in this process (key_limits.LocalCounters). The rules are
key_limits.py's.

    ...:ratelimit:{key_id}:req:{window}   requests in a one-minute window (INCR)
    ...:ratelimit:{key_id}:tok:{window}   tokens in it (INCRBY)                  both expire
    ...:ratelimit:{key_id}:leases         sorted set: lease id -> expiry (ms); expired members
                                          are dropped on every admission (cache_keys.py)

An admission is one MULTI/EXEC round trip (a refused one, a second to take its counts back).
A running request's output tokens are summed here and added every FLUSH_S; its lease is pushed
back every LEASE_REFRESH_S and removed when it ends (`Admission.release`, which never waits:
the removal runs as a task).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

from services.common.cache_keys import RateLimitKeys
from services.common.redis_store import RedisStore
from services.tokenizer.access.limits import (
    LEASE_REFRESH_S,
    LEASE_TTL_S,
    WINDOW_S,
    KeyLimits,
    LocalCounters,
    Quota,
    WindowCounts,
    admitted_quota,
    over_limit,
    window_index,
    window_reset_s,
)

FLUSH_S = 1.0
"""How often a replica adds its running requests' output tokens to the shared counts."""


class RedisCounters:
    """The counts of every replica, in Redis. Each call answers None when Redis does not."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store

    async def reserve(
        self, key_id: str, lease_id: str, num_prompt_tokens: int, now: float
    ) -> WindowCounts | None:
        window = window_index(now)
        keys = RateLimitKeys(key_id)
        requests, tokens, leases = keys.requests(window), keys.tokens(window), keys.leases
        now_ms = int(now * 1000)
        lease_ttl_ms = int(LEASE_TTL_S * 1000)

        async def run(client: Any) -> list[Any]:
            async with client.pipeline(transaction=True) as pipe:
                pipe.zremrangebyscore(leases, "-inf", now_ms)
                pipe.zadd(leases, {lease_id: now_ms + lease_ttl_ms})
                pipe.zcard(leases)
                pipe.pexpire(leases, lease_ttl_ms)
                pipe.incr(requests)
                pipe.expire(requests, 2 * WINDOW_S)
                pipe.incrby(tokens, num_prompt_tokens)
                pipe.expire(tokens, 2 * WINDOW_S)
                return list(await pipe.execute())

        answer = await self.store.call("rate limit admit", run)
        if answer is None:
            return None
        num_in_flight, num_requests, num_tokens = int(answer[2]), int(answer[4]), int(answer[6])
        return WindowCounts(
            window,
            num_requests,
            num_tokens - num_prompt_tokens,
            num_in_flight,
            window_reset_s(now),
        )

    async def unreserve(
        self, key_id: str, lease_id: str, num_prompt_tokens: int, usage: WindowCounts
    ) -> None:
        keys = RateLimitKeys(key_id)
        leases, requests = keys.leases, keys.requests(usage.window)
        tokens = keys.tokens(usage.window)

        async def run(client: Any) -> None:
            async with client.pipeline(transaction=True) as pipe:
                pipe.zrem(leases, lease_id)
                pipe.decr(requests)
                pipe.decrby(tokens, num_prompt_tokens)
                await pipe.execute()

        await self.store.call("rate limit undo", run)

    async def update(
        self,
        tokens: dict[str, int],
        refreshed: list[tuple[str, str]],
        released: list[tuple[str, str]],
        now: float,
    ) -> bool:
        """Add output tokens per key, push back leases (key_id, lease_id), remove leases; False
        when Redis did not answer."""
        window = window_index(now)
        now_ms = int(now * 1000)
        lease_ttl_ms = int(LEASE_TTL_S * 1000)

        async def run(client: Any) -> bool:
            async with client.pipeline(transaction=False) as pipe:
                for key_id, num_tokens in tokens.items():
                    pipe.incrby(RateLimitKeys(key_id).tokens(window), num_tokens)
                    pipe.expire(RateLimitKeys(key_id).tokens(window), 2 * WINDOW_S)
                for key_id, lease_id in refreshed:
                    leases = RateLimitKeys(key_id).leases
                    # xx: a lease that expired (Redis was away) stays gone rather than return.
                    pipe.zadd(leases, {lease_id: now_ms + lease_ttl_ms}, xx=True)
                    pipe.pexpire(leases, lease_ttl_ms)
                for key_id, lease_id in released:
                    pipe.zrem(RateLimitKeys(key_id).leases, lease_id)
                await pipe.execute()
            return True

        return bool(await self.store.call("rate limit update", run))


class Admission:
    """One admitted request's place in its key's counts, until `release`."""

    __slots__ = ("key_id", "lease_id", "limiter", "pending_tokens", "quota", "released", "shared")

    def __init__(
        self, limiter: KeyLimiter, key_id: str, lease_id: str, shared: bool, quota: Quota
    ) -> None:
        self.limiter = limiter
        self.key_id = key_id
        self.lease_id = lease_id
        self.shared = shared
        """Counted in Redis (False: in this process)."""
        self.quota = quota
        """The key's rpm and tpm use as the request was admitted (the response headers)."""
        self.pending_tokens = 0
        self.released = False

    def on_tokens(self, num_tokens: int) -> None:
        """Output tokens generated for the request (every choice's)."""
        if self.released or num_tokens <= 0:
            return
        if self.shared:
            self.pending_tokens += num_tokens
        else:
            self.limiter.local.add_tokens(self.key_id, num_tokens, self.limiter.clock())

    def release(self) -> None:
        """The request ended, however it ended (idempotent; never waits)."""
        if self.released:
            return
        self.released = True
        self.limiter.release(self)


class KeyLimiter:
    """Admits or refuses a request for its key's limits, and tracks the admitted ones."""

    def __init__(
        self, redis: RedisStore | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.shared = RedisCounters(redis) if redis is not None else None
        self.local = LocalCounters()
        self.clock = clock
        self._live: dict[str, Admission] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refresher: asyncio.Task[None] | None = None

    async def admit(
        self, key_id: str, limits: KeyLimits, num_prompt_tokens: int
    ) -> Admission | None:
        """The request's admission (None: its key has no limits). Raises KeyOverLimitError
        naming the limit it is over, with the retry hint and the key's quota."""
        if limits.unlimited:
            return None
        lease_id = uuid.uuid4().hex  # not the request id: a client may reuse those
        now = self.clock()
        usage = None
        if self.shared is not None:
            try:
                usage = await self.shared.reserve(key_id, lease_id, num_prompt_tokens, now)
            except asyncio.CancelledError:
                # The client left while Redis was asked: the lease may be in; take it out.
                self._spawn(self.shared.update({}, [], [(key_id, lease_id)], now))
                raise
        shared = usage is not None
        if usage is None:
            usage = self.local.reserve(key_id, lease_id, num_prompt_tokens, now)
        refusal = over_limit(limits, usage)
        if refusal is not None:
            if shared:
                assert self.shared is not None
                await self.shared.unreserve(key_id, lease_id, num_prompt_tokens, usage)
            else:
                self.local.unreserve(key_id, lease_id, num_prompt_tokens, usage)
            raise refusal
        quota = admitted_quota(limits, usage, num_prompt_tokens)
        admission = Admission(self, key_id, lease_id, shared, quota)
        self._live[lease_id] = admission
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        return admission

    def release(self, admission: Admission) -> None:
        self._live.pop(admission.lease_id, None)
        if not admission.shared:
            self.local.release(admission.key_id, admission.lease_id)
            return
        assert self.shared is not None
        tokens = {admission.key_id: admission.pending_tokens} if admission.pending_tokens else {}
        admission.pending_tokens = 0
        released = [(admission.key_id, admission.lease_id)]
        self._spawn(self.shared.update(tokens, [], released, self.clock()))

    def _spawn(self, work: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(work)
        except RuntimeError:  # no loop (a stream collected after its loop closed)
            work.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh_forever(self) -> None:
        """While requests run: their output tokens into the shared counts every FLUSH_S, their
        leases pushed back every LEASE_REFRESH_S (local ones too: the same expiry rules)."""
        last_refresh = self.clock()
        while self._live:
            await asyncio.sleep(FLUSH_S)
            now = self.clock()
            tokens: dict[str, int] = {}
            refreshed: list[tuple[str, str]] = []
            refresh = now - last_refresh >= LEASE_REFRESH_S
            for admission in list(self._live.values()):
                if admission.shared and admission.pending_tokens:
                    tokens[admission.key_id] = (
                        tokens.get(admission.key_id, 0) + admission.pending_tokens
                    )
                    admission.pending_tokens = 0
                if not refresh:
                    continue
                if admission.shared:
                    refreshed.append((admission.key_id, admission.lease_id))
                else:
                    self.local.refresh(admission.key_id, admission.lease_id, now)
            if refresh:
                last_refresh = now
            if (tokens or refreshed) and self.shared is not None:
                await self.shared.update(tokens, refreshed, [], now)

    async def close(self) -> None:
        """Finish the pending Redis updates; stop refreshing."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
