"""How many LoRA adapters one step may mix: the worker holds at most `max_loras` in its device
slots, and a running request keeps its adapter's slot until it stops running. So a waiting
request is admitted only if its adapter is one the running requests use already, or a slot
is left (pure: the scheduler core asks, once per admission).

A request whose adapter has no slot is passed over, not waited for: the requests behind it
(the base model, adapters in slots) go first, as vLLM does. It is admitted as soon as the
running requests of some adapter have all finished.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.contracts.errors import InvalidRequestError
from services.scheduler.request import Request


class LoraAdmission:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._in_use: set[str] = set()

    def check_servable(self, request: Request) -> None:
        """Raises InvalidRequestError for an adapter on a worker that serves none."""
        if request.lora_name and not self.max_loras:
            raise InvalidRequestError("lora_name", "the worker serves no LoRA adapters")

    def start_admission(self, running: Iterable[Request]) -> None:
        """The adapters the running requests hold, before this step admits anyone."""
        self._in_use = {r.lora_name for r in running if r.lora_name} if self.max_loras else set()

    def admits(self, request: Request) -> bool:
        name = request.lora_name
        return not name or name in self._in_use or len(self._in_use) < self.max_loras

    def note_admitted(self, request: Request) -> None:
        if request.lora_name:
            self._in_use.add(request.lora_name)

    @staticmethod
    def in_use(running: Iterable[Request]) -> frozenset[str]:
        """Adapters the running requests use now: in the worker's slots."""
        return frozenset(r.lora_name for r in running if r.lora_name)
