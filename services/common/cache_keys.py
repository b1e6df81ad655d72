"""The Redis key layout, in one place: every process that reads or writes Redis uses these.

    llmserve:v1:{model}:blk:{scheduler_id}:{block_hash_hex} -> worker epoch   (TTL)
        "this scheduler holds this full block in its prefix cache"; an entry whose epoch is
        not the scheduler's current worker epoch is stale (the worker restarted) and ignored.
        "{epoch}:disk": the block is not in the KV pool but in the worker's disk tier (loaded
        back before a prefill, far cheaper than recomputing it).
    llmserve:v1:{model}:prompt:{tenant}:{name}              -> named prompt JSON (TTL)
    llmserve:v1:ratelimit:{key_id}:req:{window}             -> requests of an API key in a
    llmserve:v1:ratelimit:{key_id}:tok:{window}             -> tokens   one-minute window (TTL)
    llmserve:v1:ratelimit:{key_id}:leases                   -> sorted set: lease id -> expiry ms
    llmserve:v1:response:{owner}:{response_id}              -> stored Open Responses JSON (TTL)

Keys are scoped by model: schedulers serving different models never share entries; an API
key's limits hold whatever the model. Scheduler ids, model names and key ids are sanitized so
they cannot inject separators or glob characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.prefix_hash import BlockHash, tenant_salt

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
PROMPT_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


def _safe(part: str) -> str:
    return _UNSAFE.sub("_", part) or "_"


def tenant_key(tenant_id: str) -> str:
    # Hashed, not sanitized: two tenant ids must never map to one key.
    return tenant_salt(tenant_id).hex() if tenant_id else "shared"


DISK_TIER_SUFFIX = ":disk"


def block_entry(epoch: str, *, on_disk: bool) -> str:
    """The value of a block's entry: the worker epoch, tagged when the block is on disk only."""
    return epoch + DISK_TIER_SUFFIX if on_disk else epoch


def current_entries(epoch: str) -> frozenset[bytes]:
    """The values an entry of this worker epoch may hold (in the pool, on disk); any other
    value is stale."""
    return frozenset({epoch.encode(), block_entry(epoch, on_disk=True).encode()})


@dataclass(frozen=True, slots=True)
class CacheKeys:
    model: str

    @property
    def prefix(self) -> str:
        return f"llmserve:v1:{_safe(self.model)}"

    def block(self, scheduler_id: str, block_hash: BlockHash) -> str:
        return f"{self.prefix}:blk:{_safe(scheduler_id)}:{block_hash.hex()}"

    def prompt(self, tenant_id: str, name: str) -> str:
        return f"{self.prefix}:prompt:{tenant_key(tenant_id)}:{name}"

    def prompt_pattern(self, tenant_id: str | None) -> str:
        """SCAN pattern of one tenant's prompts (None: every tenant's)."""
        tenant = "*" if tenant_id is None else tenant_key(tenant_id)
        return f"{self.prefix}:prompt:{tenant}:*"


@dataclass(frozen=True, slots=True)
class RateLimitKeys:
    """The counts of one API key's limits (services/tokenizer/access/limiter.py)."""

    key_id: str

    @property
    def prefix(self) -> str:
        return f"llmserve:v1:ratelimit:{_safe(self.key_id)}"

    def requests(self, window: int) -> str:
        return f"{self.prefix}:req:{window}"

    def tokens(self, window: int) -> str:
        return f"{self.prefix}:tok:{window}"

    @property
    def leases(self) -> str:
        return f"{self.prefix}:leases"


def stored_response_key(owner: str, response_id: str) -> str:
    """A stored response (POST /v1/responses with store): its owner (a tenant or an API key)
    hashed as tenants are, so one owner's key never names another's response."""
    return f"llmserve:v1:response:{tenant_key(owner)}:{_safe(response_id)}"
