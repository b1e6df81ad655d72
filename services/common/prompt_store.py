"""Named prompts in Redis: save, get, delete, list. Best effort like every Redis call here:
None means "Redis did not answer", distinct from "no such prompt"."""

from __future__ import annotations

from typing import Any

from services.common.cache_keys import CacheKeys
from services.common.named_prompt import NamedPrompt
from services.common.redis_store import RedisStore

_SCAN_COUNT = 500


class PromptStore:
    def __init__(self, store: RedisStore, keys: CacheKeys) -> None:
        self.store = store
        self.keys = keys

    async def save(self, prompt: NamedPrompt) -> bool:
        key = self.keys.prompt(prompt.tenant_id, prompt.name)
        ttl_ms = max(1, prompt.ttl_s * 1000)
        result = await self.store.call(
            "save prompt", lambda client: client.set(key, prompt.to_json(), px=ttl_ms)
        )
        return bool(result)

    async def get(self, tenant_id: str, name: str) -> tuple[bool, NamedPrompt | None]:
        """(answered, prompt): answered is False when Redis could not be asked."""
        key = self.keys.prompt(tenant_id, name)
        sentinel: list[Any] = []

        async def read(client: Any) -> Any:
            value = await client.get(key)
            return sentinel if value is None else value

        value = await self.store.call("get prompt", read)
        if value is None:
            return False, None
        if value is sentinel:
            return True, None
        return True, NamedPrompt.from_json(value)

    async def delete(self, tenant_id: str, name: str) -> bool | None:
        key = self.keys.prompt(tenant_id, name)
        deleted = await self.store.call("delete prompt", lambda client: client.delete(key))
        return None if deleted is None else bool(deleted)

    async def list(self, tenant_id: str | None) -> list[NamedPrompt] | None:
        """Every prompt of a tenant (None: of all tenants); None when Redis did not answer."""
        pattern = self.keys.prompt_pattern(tenant_id)

        async def scan(client: Any) -> list[bytes]:
            keys = [key async for key in client.scan_iter(match=pattern, count=_SCAN_COUNT)]
            if not keys:
                return []
            return [value for value in await client.mget(keys) if value is not None]

        values = await self.store.call("list prompts", scan)
        if values is None:
            return None
        return sorted(
            (NamedPrompt.from_json(value) for value in values),
            key=lambda prompt: (prompt.tenant_id, prompt.name),
        )
