"""Redis as a best-effort metadata store: every call answers or misses, and never raises.

Redis holds hints (where a prefix is cached, the token ids of named prompts), never the truth,
so a Redis that is down, slow or flushed must cost a cache miss and nothing more:

- each call has a short deadline (`op_timeout_s`), so a slow Redis cannot stall serving;
- after a failure the store stays "down" for `retry_after_s` and answers None at once, so a
  dead Redis costs no timeouts per request; the next call after that retries (redis-py
  reconnects by itself), and recovery needs no restart;
- the first failure and the recovery each log one line; `num_errors` counts every failure.

URLs: redis://[user:password@]host:port[/db] (AUTH and ACL users), rediss://... for TLS
(`?ssl_ca_certs=/path/ca.pem&ssl_cert_reqs=required` as redis-py reads them), unix:///path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as redis_asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

T = TypeVar("T")


class RedisObserver(Protocol):
    """Where the store reports its health (a service's metrics)."""

    def failed(self, operation: str) -> None: ...

    def answered(self) -> None: ...


def redact_url(url: str) -> str:
    """The URL with its password replaced, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


class RedisStore:
    def __init__(
        self,
        url: str,
        *,
        op_timeout_s: float = 0.25,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        observer: RedisObserver | None = None,
    ) -> None:
        self.url = url
        self.observer = observer
        self.op_timeout_s = op_timeout_s
        self.retry_after_s = retry_after_s
        self._clock = clock
        self.client = redis_asyncio.from_url(
            url,
            socket_timeout=op_timeout_s,
            socket_connect_timeout=op_timeout_s,
            decode_responses=False,
            # After a Redis restart every pooled connection is dead; one retry on a fresh
            # connection makes the first call after it succeed instead of tripping the breaker.
            retry=Retry(NoBackoff(), retries=1),
            retry_on_error=[RedisConnectionError],
        )
        self._down_until = 0.0
        self._down = False
        self.num_errors = 0
        self.num_recoveries = 0
        """Bumped each time Redis answers again after a failure: writers resync on it."""

    @property
    def available(self) -> bool:
        return not self._down

    async def call(
        self, what: str, operation: Callable[[redis_asyncio.Redis], Awaitable[T]]
    ) -> T | None:
        """Run `operation(client)`; None when Redis is down, slow or failing (a miss)."""
        if self._down and self._clock() < self._down_until:
            return None
        try:
            result = await asyncio.wait_for(operation(self.client), self.op_timeout_s * 4)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(what, exc)
            return None
        if self._down:
            self._down = False
            self.num_recoveries += 1
            if self.observer is not None:
                self.observer.answered()
            log.warning("redis available again", extra={"redis": redact_url(self.url)})
        return result

    def _failed(self, what: str, exc: BaseException) -> None:
        self.num_errors += 1
        if self.observer is not None:
            self.observer.failed(what)
        self._down_until = self._clock() + self.retry_after_s
        if not self._down:
            self._down = True
            log.warning(
                "redis unavailable: serving without it",
                extra={
                    "redis": redact_url(self.url),
                    "operation": what,
                    "error": f"{type(exc).__name__}: {exc}",
                },
            )

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self.client.aclose()


def open_store(url: str | None, observer: RedisObserver | None = None) -> RedisStore | None:
    """A store for `url`, or None when no URL is configured (Redis is optional)."""
    if not url:
        return None
    return RedisStore(url, observer=observer)
