"""Named system prompts, as this tokenizer replica sees them.

With Redis, a prompt registered on any replica is visible to all: the record (text and the
token ids of the rendered system turn) lives in Redis with its TTL, and each replica keeps a
copy it re-reads after `refresh_s` (so deletes and re-registrations propagate). When Redis
stops answering, a replica keeps serving the copies it has until they expire. Without Redis
the registry is this replica's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.named_prompt import NamedPrompt
from services.common.prompt_store import PromptStore
from services.contracts.errors import (
    DependencyUnavailableError,
    InvalidRequestError,
    NotFoundError,
    quoted,
)
from services.text.chat_template import ChatMessage
from services.tokenizer.validation import validate_prompt_name, validate_tenant_id


@dataclass(frozen=True, slots=True)
class _Copy:
    prompt: NamedPrompt
    fetched_at: float


class PromptRegistry:
    def __init__(
        self,
        store: PromptStore | None,
        render_ids: Callable[[str], list[int]],
        *,
        default_ttl_s: int = 3600,
        max_ttl_s: int = 7 * 24 * 3600,
        max_model_len: int | None = None,
        max_prompt_chars: int | None = None,
        refresh_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`render_ids(system_prompt)`: the token ids of the system turn alone."""
        self.store = store
        self.render_ids = render_ids
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars
        self.refresh_s = refresh_s
        self._clock = clock
        self._copies: dict[tuple[str, str], _Copy] = {}

    def build(self, name: str, system_prompt: str, ttl_s: int, tenant_id: str) -> NamedPrompt:
        """Validate a registration and tokenize it (InvalidRequestError names the field)."""
        validate_prompt_name(name)
        validate_tenant_id(tenant_id)
        if not system_prompt:
            raise InvalidRequestError("system_prompt", "must not be empty")
        if self.max_prompt_chars is not None and len(system_prompt) > self.max_prompt_chars:
            raise InvalidRequestError(
                "system_prompt",
                f"has {len(system_prompt)} characters; the context holds at most "
                f"{self.max_prompt_chars}",
            )
        if ttl_s > self.max_ttl_s:
            raise InvalidRequestError("ttl_s", f"must be at most {self.max_ttl_s} seconds")
        ttl = ttl_s or self.default_ttl_s
        try:
            token_ids = tuple(self.render_ids(system_prompt))
        except InvalidRequestError as exc:
            # The chat template's refusal (no template, no system role) is about this field.
            raise InvalidRequestError("system_prompt", exc.message) from exc
        if self.max_model_len is not None and len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "system_prompt",
                f"is {len(token_ids)} tokens; max_model_len is {self.max_model_len}",
            )
        return NamedPrompt(
            name=name,
            tenant_id=tenant_id,
            system_prompt=system_prompt,
            token_ids=token_ids,
            expires_unix_s=self._clock() + ttl,
            ttl_s=ttl,
        )

    async def save(self, prompt: NamedPrompt) -> None:
        if self.store is not None and not await self.store.save(prompt):
            raise DependencyUnavailableError("redis is not answering: the prompt was not saved")
        self._copies[(prompt.tenant_id, prompt.name)] = _Copy(prompt, self._clock())

    async def get(self, tenant_id: str, name: str) -> NamedPrompt:
        """The live prompt of that name, or NotFoundError / DependencyUnavailableError (a name
        or tenant no registration could have: InvalidRequestError, before any lookup)."""
        validate_prompt_name(name, "prompt_name")
        validate_tenant_id(tenant_id)
        now = self._clock()
        copy = self._copies.get((tenant_id, name))
        if copy is not None and copy.prompt.expired(now):
            del self._copies[(tenant_id, name)]
            copy = None
        if self.store is None or (copy is not None and now - copy.fetched_at < self.refresh_s):
            if copy is None:
                raise NotFoundError("prompt_name", f"no registered prompt named {quoted(name)}")
            return copy.prompt
        answered, prompt = await self.store.get(tenant_id, name)
        if answered:
            if prompt is None or prompt.expired(now):
                self._copies.pop((tenant_id, name), None)
                raise NotFoundError("prompt_name", f"no registered prompt named {quoted(name)}")
            self._copies[(tenant_id, name)] = _Copy(prompt, now)
            return prompt
        if copy is not None:
            return copy.prompt  # Redis is down: serve what this replica already knows
        raise DependencyUnavailableError(
            f"prompt_name: redis is not answering and {quoted(name)} is not known to this replica"
        )

    async def delete(self, tenant_id: str, name: str) -> bool:
        validate_prompt_name(name)
        validate_tenant_id(tenant_id)
        had_copy = self._copies.pop((tenant_id, name), None) is not None
        if self.store is None:
            return had_copy
        deleted = await self.store.delete(tenant_id, name)
        if deleted is None:
            raise DependencyUnavailableError("redis is not answering: the prompt was not deleted")
        return deleted

    async def list(self, tenant_id: str) -> list[NamedPrompt]:
        validate_tenant_id(tenant_id)
        now = self._clock()
        if self.store is None:
            return sorted(
                (
                    c.prompt
                    for (tenant, _), c in self._copies.items()
                    if tenant == tenant_id and not c.prompt.expired(now)
                ),
                key=lambda p: p.name,
            )
        prompts = await self.store.list(tenant_id)
        if prompts is None:
            raise DependencyUnavailableError("redis is not answering")
        return [p for p in prompts if not p.expired(now)]


def system_turn(system_prompt: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage(role="system", content=system_prompt),)
