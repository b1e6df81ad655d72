"""Asks the Redis prefix index how much of a prompt each scheduler holds in its cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.common.cache_keys import CacheKeys, current_entries
from services.common.prefix_hash import BlockHash
from services.common.redis_store import RedisStore

MAX_LOOKUP_BLOCKS = 512
"""Longest prefix looked up (blocks): bounds one MGET; longer prompts route on their head."""


class PrefixLocator:
    def __init__(self, store: RedisStore, keys: CacheKeys) -> None:
        self.store = store
        self.keys = keys

    async def cached_blocks(
        self, block_hashes: Sequence[BlockHash], schedulers: Sequence[tuple[str, str]]
    ) -> list[int]:
        """For each (scheduler_id, worker_epoch): how many leading blocks it holds, in its KV
        pool or its disk tier. Entries of another epoch are stale (written before a worker
        restart) and do not count. All zeros
        when Redis does not answer: a routing miss, never an error."""
        hashes = list(block_hashes[:MAX_LOOKUP_BLOCKS])
        if not hashes or not schedulers:
            return [0] * len(schedulers)
        keys = [self.keys.block(sid, h) for sid, _ in schedulers for h in hashes]

        async def read(client: Any) -> list[bytes | None]:
            return list(await client.mget(keys))

        values = await self.store.call("prefix lookup", read)
        if values is None:
            return [0] * len(schedulers)
        counts: list[int] = []
        for index, (_, epoch) in enumerate(schedulers):
            row = values[index * len(hashes) : (index + 1) * len(hashes)]
            current = current_entries(epoch)
            count = 0
            for value in row:
                if value not in current:
                    break
                count += 1
            counts.append(count)
        return counts
