"""LoRA adapters across the scheduler pool, as this tokenizer replica sees and changes them.

Names: the adapters the schedulers' stats list (their union) are what a request's `model` may
name besides the served model. Stats lag: a replica learns of an adapter loaded through
another one at its next poll, so a name unknown here has the stats read once more before it
is refused (`names_for`).

Load and unload go to every scheduler of the pool at once; this replica then reads their stats
again, so the change holds through it at once. Their answers merge as follows (a scheduler that
does not answer, being down or gone, is left out and logged; none answering is UNAVAILABLE):

    load     every answering scheduler holds the adapter afterwards (it loaded it now, or
             answered ALREADY_EXISTS) -> the adapter; ALREADY_EXISTS from all -> that error;
             any other refusal -> the first refusal, naming the schedulers that refused and
             how many hold the adapter. Nothing is rolled back: loading again once the cause
             is fixed converges, as the schedulers holding it answer ALREADY_EXISTS.
    unload   dropped by every answering scheduler (NOT_FOUND counts: it holds none) -> how
             many dropped it; NOT_FOUND from all -> that error; any other refusal -> the
             first, named as above.
    list     by name over the answering schedulers, with how many hold each.

A refusal every scheduler gave for the same reason is passed on as it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import grpc

from protos.llmserve.v1 import lora_pb2, scheduler_pb2_grpc
from services.contracts.errors import (
    AlreadyExistsError,
    DependencyUnavailableError,
    InvalidRequestError,
    LLMServeError,
    NotFoundError,
    quoted,
)
from services.tokenizer.routing import scheduler_convert
from services.tokenizer.routing.adapter_info import AdapterInfo
from services.tokenizer.routing.pool import SchedulerClient, SchedulerPool, closed_under
from services.tokenizer.routing.scheduler_errors import scheduler_error, scheduler_gone

log = logging.getLogger(__name__)

MAX_ADAPTER_NAME_LEN = 128
MAX_ADAPTER_PATH_LEN = 4096
"""Linux's PATH_MAX."""
LOAD_TIMEOUT_S = 120.0
"""A worker reads, checks and places the adapter: seconds for a large one on a slow disk."""
UNLOAD_TIMEOUT_S = 600.0
"""An unload returns once the requests holding the adapter have finished: long generations."""
LIST_TIMEOUT_S = 5.0
MAX_NAMED_SCHEDULERS = 4
"""Schedulers an error names one by one; the rest are counted."""

LORA_FIELDS = {"lora_name": "name", "lora_path": "path"}
"""A scheduler's field names for an adapter, as the LoRA calls' requests spell them."""

T = TypeVar("T")
Stub = scheduler_pb2_grpc.SchedulerStub


@dataclass(frozen=True, slots=True)
class Answer(Generic[T]):
    """One scheduler's answer to a fanned-out call: its value, or the error it became."""

    address: str
    value: T | None = None
    error: LLMServeError | None = None


def check_adapter_name(name: str, base: str) -> None:
    """A name a LoRA adapter may take: requests name it by `model`, so never the base's."""
    if not 1 <= len(name) <= MAX_ADAPTER_NAME_LEN or not name.isprintable():
        raise InvalidRequestError("name", f"must be 1-{MAX_ADAPTER_NAME_LEN} printable characters")
    if name == base:
        raise InvalidRequestError("name", f"{quoted(name)} is the base model's name")


def check_adapter_path(path: str) -> None:
    if not 1 <= len(path) <= MAX_ADAPTER_PATH_LEN or not path.isprintable():
        raise InvalidRequestError("path", f"must be 1-{MAX_ADAPTER_PATH_LEN} printable characters")


class PoolAdapters:
    """The pool's adapters: the names requests may use, and the calls that change them."""

    def __init__(self, pool: SchedulerPool) -> None:
        self.pool = pool
        self._refresh: asyncio.Future[None] | None = None

    def names(self) -> frozenset[str]:
        """Every adapter some scheduler's last stats list."""
        return frozenset().union(
            *(c.stats.lora_adapters for c in self.pool.clients if c.stats is not None)
        )

    def listed(self, base: str) -> list[str]:
        """The adapters as model listings show them, sorted; one loaded on a scheduler under
        the base model's name (not through this tier, which refuses that name) is left out:
        `model` naming it means the base model."""
        return sorted(self.names() - {base})

    async def names_for(self, model: str, base: str) -> frozenset[str]:
        """The adapter names a request's `model` may be checked against: when it is neither
        the base model nor a known adapter, after reading every scheduler's stats once more
        (one read, at most a second, shared by the requests that wait for it)."""
        names = self.names()
        if not model or model == base or model in names or len(model) > MAX_ADAPTER_NAME_LEN:
            return names
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self.pool.refresh_stats())
        # Shielded: a waiter that goes away must not cancel the read the others share.
        await asyncio.shield(self._refresh)
        if not any(c.stats is not None for c in self.pool.clients):
            raise DependencyUnavailableError(
                f"no scheduler answers: cannot tell whether model {quoted(model)} names a "
                "LoRA adapter"
            )
        return self.names()

    async def load(
        self, name: str, path: str, base: str, timeout_s: float | None = None
    ) -> AdapterInfo:
        """Loads the adapter on every scheduler (see the module docstring for the outcome);
        `base`: the served model's name. InvalidRequestError names "name" or "path"."""
        check_adapter_name(name, base)
        check_adapter_path(path)
        request = lora_pb2.LoadLoraAdapterRequest(name=name, path=path)
        timeout = _within(LOAD_TIMEOUT_S, timeout_s)

        async def load_on(stub: Stub) -> AdapterInfo:
            answer = await stub.LoadLoraAdapter(request, timeout=timeout)
            return scheduler_convert.adapter_info(answer)

        answers = await self._fan_out("LoadLoraAdapter", load_on)
        await self.pool.refresh_stats()
        return merged_load(name, base, answers)

    async def unload(self, name: str, timeout_s: float | None = None) -> int:
        """Unloads the adapter from every scheduler; returns how many dropped it."""
        if not 1 <= len(name) <= MAX_ADAPTER_NAME_LEN:
            raise InvalidRequestError("name", f"must be 1-{MAX_ADAPTER_NAME_LEN} characters")
        request = lora_pb2.UnloadLoraAdapterRequest(name=name)
        timeout = _within(UNLOAD_TIMEOUT_S, timeout_s)

        async def unload_on(stub: Stub) -> bool:
            await stub.UnloadLoraAdapter(request, timeout=timeout)
            return True

        answers = await self._fan_out("UnloadLoraAdapter", unload_on)
        await self.pool.refresh_stats()
        return merged_unload(name, answers)

    async def describe(self, base: str, timeout_s: float | None = None) -> list[AdapterInfo]:
        """Every adapter of the pool, by name, as the schedulers describe them now."""
        request = lora_pb2.ListLoraAdaptersRequest()
        timeout = _within(LIST_TIMEOUT_S, timeout_s)

        async def list_on(stub: Stub) -> list[AdapterInfo]:
            answer = await stub.ListLoraAdapters(request, timeout=timeout)
            return [scheduler_convert.adapter_info(info) for info in answer.adapters]

        return merged_list(base, await self._fan_out("ListLoraAdapters", list_on))

    async def _fan_out(self, method: str, call: Callable[[Stub], Awaitable[T]]) -> list[Answer[T]]:
        """`call` on every scheduler of the pool at once; each answer in pool order."""

        async def on(client: SchedulerClient) -> Answer[T]:
            if client.closed:
                return Answer(client.address, error=scheduler_gone(client))
            try:
                return Answer(client.address, await call(client.stub))
            except grpc.aio.AioRpcError as exc:
                error = scheduler_error(exc, client.address, public_fields=LORA_FIELDS)
                return Answer(client.address, error=error)
            except asyncio.CancelledError:
                if closed_under(client):  # it left the pool during the call
                    return Answer(client.address, error=scheduler_gone(client))
                raise

        answers = list(await asyncio.gather(*(on(c) for c in self.pool.clients)))
        for answer in answers:
            if isinstance(answer.error, DependencyUnavailableError):
                log.warning(
                    "scheduler did not answer a LoRA adapter call",
                    extra={
                        "scheduler": answer.address,
                        "method": method,
                        "error": str(answer.error),
                    },
                )
        return answers


def _within(default_s: float, timeout_s: float | None) -> float:
    """The call's timeout: its default, or the caller's remaining time when shorter."""
    return default_s if timeout_s is None else min(default_s, timeout_s)


# ---- merging the answers (pure) ---------------------------------------------------------


def merged_load(name: str, parent: str, answers: Sequence[Answer[AdapterInfo]]) -> AdapterInfo:
    loaded = [a.value for a in answers if a.value is not None]
    num_holding = len(loaded) + sum(isinstance(a.error, AlreadyExistsError) for a in answers)
    refused = _refused(answers, AlreadyExistsError)
    if refused:
        raise _refusal(refused, answers, f"loaded on {num_holding} of {len(answers)} schedulers")
    if not num_holding:
        raise _none_answered(answers, "LoadLoraAdapter")
    if not loaded:
        raise AlreadyExistsError(f"LoRA adapter {quoted(name)} is loaded already; unload it first")
    return replace(
        loaded[0],
        load_ms=max(info.load_ms for info in loaded),
        parent=parent,
        num_loaded_schedulers=num_holding,
    )


def merged_unload(name: str, answers: Sequence[Answer[bool]]) -> int:
    num_dropped = sum(a.value is not None for a in answers)
    refused = _refused(answers, NotFoundError)
    if refused:
        raise _refusal(refused, answers, f"unloaded on {num_dropped} of {len(answers)} schedulers")
    if not num_dropped and not any(isinstance(a.error, NotFoundError) for a in answers):
        raise _none_answered(answers, "UnloadLoraAdapter")
    if not num_dropped:
        raise NotFoundError("name", f"no LoRA adapter {quoted(name)} is loaded")
    return num_dropped


def merged_list(parent: str, answers: Sequence[Answer[list[AdapterInfo]]]) -> list[AdapterInfo]:
    """Each adapter once, sorted by name: the first scheduler's description, the pool's
    running sequences, the slowest load, how many hold it."""
    lists = [a.value for a in answers if a.value is not None]
    if not lists and answers:
        raise _none_answered(answers, "ListLoraAdapters")
    by_name: dict[str, AdapterInfo] = {}
    for infos in lists:
        for info in infos:
            seen = by_name.get(info.name)
            if seen is None:
                by_name[info.name] = replace(info, parent=parent, num_loaded_schedulers=1)
                continue
            by_name[info.name] = replace(
                seen,
                load_ms=max(seen.load_ms, info.load_ms),
                num_running=seen.num_running + info.num_running,
                num_loaded_schedulers=seen.num_loaded_schedulers + 1,
            )
    return [by_name[name] for name in sorted(by_name)]


def _refused(answers: Sequence[Answer[T]], harmless: type[LLMServeError]) -> list[Answer[T]]:
    """The answers that refused the call, beyond `harmless` (the outcome wanted already) and
    schedulers that did not answer."""
    return [
        a
        for a in answers
        if a.error is not None and not isinstance(a.error, (harmless, DependencyUnavailableError))
    ]


def _refusal(
    refused: Sequence[Answer[T]], answers: Sequence[Answer[T]], outcome: str
) -> LLMServeError:
    """The first refusal; named by scheduler unless every scheduler gave that same one."""
    first = refused[0].error
    assert first is not None
    if len(refused) == len(answers) and all(
        type(a.error) is type(first) and str(a.error) == str(first) for a in refused
    ):
        return first
    named = ", ".join(a.address for a in refused[:MAX_NAMED_SCHEDULERS])
    if len(refused) > MAX_NAMED_SCHEDULERS:
        named += f" and {len(refused) - MAX_NAMED_SCHEDULERS} more"
    silent = sum(isinstance(a.error, DependencyUnavailableError) for a in answers)
    note = f" (refused by {named}; {outcome}"
    note += f"; {silent} did not answer)" if silent else ")"
    return _with_note(first, note)


def _with_note(error: LLMServeError, note: str) -> LLMServeError:
    """The same error, its message extended (a field error keeps its field)."""
    if isinstance(error, (InvalidRequestError, NotFoundError)):
        return type(error)(error.field, error.message + note)
    return type(error)(str(error) + note)


def _none_answered(answers: Sequence[Answer[T]], method: str) -> DependencyUnavailableError:
    if not answers:
        return DependencyUnavailableError(f"{method}: no scheduler in the pool")
    first = answers[0].error
    return DependencyUnavailableError(
        f"{method}: none of the {len(answers)} schedulers answered ({first})"
    )
