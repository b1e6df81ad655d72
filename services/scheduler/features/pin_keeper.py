"""Pins that outlive a worker: the prefixes this scheduler was asked to keep (Pin, and the named
prompts registered in Redis), each until its TTL, pinned again whenever a worker connects.

The block-level pin is the scheduler core's (pins.py); this keeps the list and computes each
prefix through the loop like any request (a one-token prefill whose blocks stay pinned).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from services.common.named_prompt import NamedPrompt, pin_name
from services.common.prefix_hash import tenant_salt
from services.contracts.errors import LLMServeError
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import TokenEvent
from services.scheduler.features.pins import PinnedPrefixes
from services.scheduler.request import Request

log = logging.getLogger(__name__)

EventQueue = asyncio.Queue[TokenEvent | BaseException]

# Named prompts registered for a model (by name); None when Redis did not answer.
PromptSource = Callable[[str], Awaitable[list[NamedPrompt] | None]]


class Submit(Protocol):
    """Queues a request in the loop; a pinning request names its pin."""

    def __call__(self, request: Request, *, pin_name: str | None = None) -> EventQueue: ...


@dataclass(frozen=True, slots=True)
class PinSpec:
    """A prefix to keep pinned until `expires_at` (the keeper's clock), across worker restarts."""

    token_ids: tuple[int, ...]
    cache_salt: bytes
    expires_at: float


class PinKeeper:
    def __init__(
        self,
        submit: Submit,
        current_pins: Callable[[], PinnedPrefixes | None],
        clock: Callable[[], float],
        registered_prompts: PromptSource | None = None,
    ) -> None:
        """`submit` queues a request in the loop; `current_pins` are the pins of the loop's
        scheduler of the moment (None while no worker is connected; new ones after a
        reconnect)."""
        self.submit = submit
        self.current_pins = current_pins
        self.clock = clock
        self.registered_prompts = registered_prompts
        self._specs: dict[str, PinSpec] = {}

    async def pin(self, name: str, token_ids: list[int], cache_salt: bytes, ttl_s: float) -> int:
        """Compute the prefix (a prefill like any request's) and pin its full blocks; kept
        until ttl_s passes, re-pinned whenever a new worker connects. Returns tokens pinned."""
        spec = PinSpec(tuple(token_ids), cache_salt, self.clock() + ttl_s)
        self._specs[name] = spec
        return await self._pin_now(name, spec)

    def unpin(self, name: str) -> bool:
        spec = self._specs.pop(name, None)
        pins = self.current_pins()
        if pins is not None:
            pins.unpin(name)
        return spec is not None

    async def restore(self, model_name: str) -> None:
        """After a worker connects: pin every live prefix again, including the named prompts
        other processes registered in Redis (this scheduler may be new, or restarted)."""
        if self.registered_prompts is not None:
            prompts = await self.registered_prompts(model_name)
            now_unix, now = time.time(), self.clock()
            for prompt in prompts or []:
                if not prompt.expired(now_unix):
                    self._specs.setdefault(
                        pin_name(prompt.tenant_id, prompt.name),
                        PinSpec(
                            prompt.token_ids,
                            tenant_salt(prompt.tenant_id),
                            now + prompt.expires_unix_s - now_unix,
                        ),
                    )
        for name, spec in list(self._specs.items()):
            try:
                pinned = await self._pin_now(name, spec)
            except LLMServeError as exc:
                log.warning("re-pin failed", extra={"pin": name, "error": str(exc)})
                continue
            log.info("re-pinned", extra={"pin": name, "tokens": pinned})

    async def expire_forever(self, period_s: float = 1.0) -> None:
        """Unpin prefixes whose TTL has passed, every `period_s`, until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            now = self.clock()
            for name in [n for n, spec in self._specs.items() if spec.expires_at <= now]:
                self.unpin(name)
                log.info("pin expired", extra={"pin": name})

    async def _pin_now(self, name: str, spec: PinSpec) -> int:
        pins = self.current_pins()
        request = Request(
            request_id=f"pin:{name}:{uuid.uuid4().hex[:8]}",
            prompt_token_ids=list(spec.token_ids),
            sampling=SamplingParams(temperature=0.0, max_new_tokens=1),
            arrival_time=self.clock(),
            cache_salt=spec.cache_salt,
        )
        queue = self.submit(request, pin_name=name)
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                break
        pins_now = self.current_pins()
        if pins_now is not pins or pins_now is None:
            return 0  # the worker restarted meanwhile; the reconnect re-pins
        return pins_now.pinned_tokens(name)
