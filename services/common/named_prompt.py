"""A named system prompt as stored in Redis: written by the tokenizer tier, read by every
tokenizer replica (to serve requests that name it) and by schedulers (to pin its KV)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from services.common.cache_keys import tenant_key


@dataclass(frozen=True, slots=True)
class NamedPrompt:
    name: str
    tenant_id: str
    system_prompt: str
    token_ids: tuple[int, ...]
    """The system turn as the chat template renders it (no generation prompt)."""
    expires_unix_s: float
    ttl_s: int

    def to_json(self) -> bytes:
        record = asdict(self)
        record["token_ids"] = list(self.token_ids)
        return json.dumps(record, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> NamedPrompt:
        record = json.loads(data)
        return cls(
            name=str(record["name"]),
            tenant_id=str(record["tenant_id"]),
            system_prompt=str(record["system_prompt"]),
            token_ids=tuple(int(t) for t in record["token_ids"]),
            expires_unix_s=float(record["expires_unix_s"]),
            ttl_s=int(record["ttl_s"]),
        )

    def expired(self, now_unix_s: float) -> bool:
        return now_unix_s >= self.expires_unix_s


def pin_name(tenant_id: str, name: str) -> str:
    """What schedulers pin a named prompt's blocks under (names are unique per tenant)."""
    return f"{tenant_key(tenant_id)}/{name}"
