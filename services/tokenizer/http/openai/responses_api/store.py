"""Stored responses, per owner (a tenant, else an API key): a response's input items and output,
for `GET /v1/responses/{id}`, `DELETE` and `previous_response_id`.

With Redis (the tier's, when configured) every replica sees every stored response, for a TTL;
without it each replica keeps its own in memory, bounded (the oldest goes first). A lookup is
always under the caller's owner, so one tenant never reads another's response: under the
wrong owner it is simply not found.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.cache_keys import stored_response_key
from services.common.redis_store import RedisStore
from services.contracts.errors import DependencyUnavailableError

log = logging.getLogger(__name__)

DEFAULT_MAX_RESPONSES = 10_000
"""The in-memory store's bound."""
DEFAULT_TTL_S = 30 * 24 * 3600
"""How long Redis keeps a stored response (OpenAI keeps them 30 days)."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    """Every item the response answered: earlier turns' too, so a chain reads one entry."""

    def to_json(self) -> str:
        return json.dumps({"response": self.response, "input_items": self.input_items})

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredResponse:
        data = json.loads(text)
        return cls(data["response"], data["input_items"])


class ResponseStore(Protocol):
    async def put(self, owner: str, stored: StoredResponse) -> None: ...

    async def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, owner: str, response_id: str) -> bool: ...


class MemoryResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        self.max_responses = max_responses
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    async def put(self, owner: str, stored: StoredResponse) -> None:
        key = (owner, str(stored.response["id"]))
        self._entries[key] = stored
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return self._entries.get((owner, response_id))

    async def delete(self, owner: str, response_id: str) -> bool:
        return self._entries.pop((owner, response_id), None) is not None


class RedisResponseStore:
    """Redis is the truth here (not a hint as for the prefix index): a Redis that does not
    answer a read or a delete is a 503, never a wrong 404."""

    def __init__(self, redis: RedisStore, ttl_s: int = DEFAULT_TTL_S) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def put(self, owner: str, stored: StoredResponse) -> None:
        key = stored_response_key(owner, str(stored.response["id"]))
        text = stored.to_json()
        saved = await self.redis.call("response_put", lambda r: r.set(key, text, ex=self.ttl_s))
        if saved is None:
            # The answer is already on its way: the response is served, only not kept.
            log.warning("response not stored: redis is not answering", extra={"key": key})

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        key = stored_response_key(owner, response_id)
        text = await self._answer("response_get", lambda r: r.get(key))
        return None if text is None else StoredResponse.from_json(text)

    async def delete(self, owner: str, response_id: str) -> bool:
        key = stored_response_key(owner, response_id)
        count = await self._answer("response_delete", lambda r: r.delete(key))
        return bool(count)

    async def _answer(self, what: str, operation: Any) -> Any:
        # call() answers None both for a miss and for a Redis that is down: tell them apart
        # by wrapping the result.
        result = await self.redis.call(what, lambda r: _boxed(operation(r)))
        if result is None:
            raise DependencyUnavailableError("redis is not answering: stored responses")
        return result[0]


async def _boxed(awaitable: Any) -> tuple[Any]:
    return (await awaitable,)


def open_response_store(redis: RedisStore | None) -> ResponseStore:
    return MemoryResponseStore() if redis is None else RedisResponseStore(redis)
