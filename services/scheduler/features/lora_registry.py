"""The LoRA adapters this scheduler's worker holds, by name: which requests may name, which
to load again onto a restarted worker, and the unload that waits for their requests.

    load      worker loads it (read, checked, placed between two steps), then it is named
    unload    new requests naming it are refused at once (NOT_FOUND); once no request holds
              it (waiting or running) the worker drops it, and the call returns
    connect   the worker lists what it holds (adapters given to it at start, --lora-modules,
              and every load since it started); adapters loaded here that a restarted worker
              lost are loaded again

A request can never run with a half-loaded adapter: a name is known only once the worker's
load has returned, and the worker places it on its forward thread, between steps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.contracts.errors import InvalidRequestError, NotFoundError
from services.contracts.lora import LoraAdapterInfo
from services.scheduler.worker_client import LoraAdapterBusy, WorkerClient, WorkerUnavailable

log = logging.getLogger(__name__)

# After its last request ends, the worker hears of it with the next plan: how often an
# unload retries until then, and for how long.
UNLOAD_RETRY_S = 0.01
UNLOAD_RETRY_LIMIT_S = 10.0
DRAIN_POLL_S = 0.02


class LoraRegistry:
    def __init__(self) -> None:
        self.adapters: dict[str, LoraAdapterInfo] = {}
        """What the worker holds, as it reported each at load or at connect."""
        self._unloading: set[str] = set()
        self.max_loras = 0
        """The worker's slots (0: it serves no adapters)."""

    @property
    def names(self) -> list[str]:
        """Names requests may use now (not those being unloaded)."""
        return sorted(name for name in self.adapters if name not in self._unloading)

    def check(self, lora_name: str) -> None:
        """Raises NotFoundError unless a request may run with `lora_name` ("" = the base)."""
        if lora_name and (lora_name not in self.adapters or lora_name in self._unloading):
            raise NotFoundError("model", f"no LoRA adapter {lora_name!r} is loaded")

    async def connect(self, worker: WorkerClient, max_loras: int) -> None:
        """Learn what a (re)connected worker holds; load again what it lost."""
        self.max_loras = max_loras
        if not max_loras:
            self.adapters = {}
            return
        held = {info.name: info for info in await worker.list_lora_adapters()}
        for name, info in self.adapters.items():
            if name in held or name in self._unloading:
                continue
            try:
                held[name] = await worker.load_lora_adapter(name, info.path)
                log.info("LoRA adapter loaded again", extra={"lora_name": name})
            except WorkerUnavailable:
                raise
            except Exception as exc:  # the file went away: the adapter is gone, loudly
                log.error(
                    "LoRA adapter lost with the worker",
                    extra={"lora_name": name, "path": info.path, "error": str(exc)},
                )
        self.adapters = held
        self._unloading.clear()

    async def load(self, worker: WorkerClient, name: str, path: str) -> LoraAdapterInfo:
        if self.max_loras == 0:
            raise InvalidRequestError(
                "lora_name", "this server serves no LoRA adapters (its worker has --max-loras 0)"
            )
        if name in self._unloading:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is being unloaded")
        info = await worker.load_lora_adapter(name, path)
        self.adapters[name] = info
        return info

    async def unload(
        self, worker: WorkerClient, name: str, num_holding: Callable[[str], int]
    ) -> None:
        """Refuse new requests for `name`, wait until `num_holding(name)` (requests the
        scheduler holds with it) is 0, then drop it from the worker."""
        if name not in self.adapters or name in self._unloading:
            raise NotFoundError("model", f"no LoRA adapter {name!r} is loaded")
        self._unloading.add(name)
        try:
            while num_holding(name):
                await asyncio.sleep(DRAIN_POLL_S)
            waited = 0.0
            while True:
                try:
                    await worker.unload_lora_adapter(name)
                    break
                except LoraAdapterBusy:
                    if waited >= UNLOAD_RETRY_LIMIT_S:
                        raise
                    await asyncio.sleep(UNLOAD_RETRY_S)
                    waited += UNLOAD_RETRY_S
                except NotFoundError:
                    break  # a restarted worker that never had it again
            self.adapters.pop(name, None)
        finally:
            self._unloading.discard(name)
