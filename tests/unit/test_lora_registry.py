"""The scheduler's registry of LoRA adapters (lora_registry.py) against a fake worker client:
names become usable only once loaded, an unload refuses new requests at once and waits for
the ones holding the adapter, and a restarted worker gets back what it lost."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from services.contracts.errors import InvalidRequestError, NotFoundError
from services.contracts.lora import LoraAdapterInfo
from services.scheduler.features.lora_registry import LoraRegistry
from services.scheduler.worker_client import LoraAdapterBusy


def info(name: str, path: str = "/adapters/x") -> LoraAdapterInfo:
    return LoraAdapterInfo(name, path, 8, ("q_proj",), 2.0, 5.0, 0, 0)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """A plain test running the coroutine `test` on a fresh event loop."""
    return functools.wraps(test)(lambda: asyncio.run(test()))


class FakeWorker:
    def __init__(self, held: dict[str, str] | None = None, busy_unloads: int = 0) -> None:
        self.held = dict(held or {})
        self.busy_unloads = busy_unloads
        self.calls: list[tuple[str, Any]] = []

    async def list_lora_adapters(self) -> list[LoraAdapterInfo]:
        return [info(name, path) for name, path in self.held.items()]

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        self.calls.append(("load", name))
        self.held[name] = path
        return info(name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        if self.busy_unloads:
            self.busy_unloads -= 1
            raise LoraAdapterBusy("held by a running sequence")
        if name not in self.held:
            raise NotFoundError("model", name)
        del self.held[name]


@run
async def test_a_name_is_usable_once_loaded_and_refused_while_unloading() -> None:
    registry, worker = LoraRegistry(), FakeWorker()
    await registry.connect(worker, max_loras=2)  # type: ignore[arg-type]
    with pytest.raises(NotFoundError, match="'a'"):
        registry.check("a")
    registry.check("")  # the base model
    await registry.load(worker, "a", "/adapters/a")  # type: ignore[arg-type]
    registry.check("a")
    assert registry.names == ["a"]

    holding = {"a": 2}
    unload = asyncio.create_task(registry.unload(worker, "a", holding.__getitem__))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert not unload.done()  # two requests still hold it
    with pytest.raises(NotFoundError):
        registry.check("a")  # but no new one may name it
    assert registry.names == []
    assert ("unload", "a") not in worker.calls
    holding["a"] = 0
    await asyncio.wait_for(unload, 2)
    assert worker.held == {}
    assert registry.adapters == {}


@run
async def test_an_unload_the_worker_is_not_ready_for_is_retried() -> None:
    registry, worker = LoraRegistry(), FakeWorker(busy_unloads=3)
    await registry.connect(worker, max_loras=1)  # type: ignore[arg-type]
    await registry.load(worker, "a", "/adapters/a")  # type: ignore[arg-type]
    await asyncio.wait_for(registry.unload(worker, "a", lambda _: 0), 2)  # type: ignore[arg-type]
    assert worker.calls.count(("unload", "a")) == 4
    assert "a" not in worker.held


@run
async def test_a_restarted_worker_gets_back_the_adapters_it_lost() -> None:
    registry, worker = LoraRegistry(), FakeWorker(held={"at-start": "/adapters/s"})
    await registry.connect(worker, max_loras=2)  # type: ignore[arg-type]
    assert registry.names == ["at-start"]  # given to the worker with --lora-modules
    await registry.load(worker, "later", "/adapters/l")  # type: ignore[arg-type]
    restarted = FakeWorker(held={"at-start": "/adapters/s"})
    await registry.connect(restarted, max_loras=2)  # type: ignore[arg-type]
    assert restarted.calls == [("load", "later")]
    assert registry.names == ["at-start", "later"]
    assert restarted.held["later"] == "/adapters/l"


@run
async def test_a_worker_without_slots_takes_no_adapter() -> None:
    registry, worker = LoraRegistry(), FakeWorker()
    await registry.connect(worker, max_loras=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="max-loras"):
        await registry.load(worker, "a", "/adapters/a")  # type: ignore[arg-type]
    with pytest.raises(NotFoundError):
        await registry.unload(worker, "a", lambda _: 0)  # type: ignore[arg-type]


class FileGoneWorker(FakeWorker):
    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        raise InvalidRequestError("path", f"{path} is neither a PEFT directory nor a .gguf file")


@run
async def test_an_adapter_a_restarted_worker_cannot_load_again_is_dropped() -> None:
    registry, worker = LoraRegistry(), FakeWorker()
    await registry.connect(worker, max_loras=2)  # type: ignore[arg-type]
    await registry.load(worker, "gone", "/adapters/gone")  # type: ignore[arg-type]
    await registry.connect(FileGoneWorker(), max_loras=2)  # type: ignore[arg-type]
    assert registry.names == []
    with pytest.raises(NotFoundError, match="'gone'"):
        registry.check("gone")
