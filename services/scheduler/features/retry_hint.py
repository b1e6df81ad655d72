"""How long a caller refused for a full scheduler should wait before retrying: the steps until
a seat frees (the scheduler's estimate) times the recent step time (the step loop's timing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_RETRY_AFTER_MS = 1000
"""The hint before any step was timed (a burst refused before the first step ended): one
second, what the HTTP door's Retry-After always said before there was an estimate."""
MAX_RETRY_AFTER_MS = 10_000
"""The estimate counts tokens up to a request's length limit, and a stop token usually ends it
sooner: past a few seconds it is mostly tokens that will never be generated, so a client is
never told to wait longer than this."""


@dataclass(slots=True)
class StepTimeAverage:
    """An exponential moving average of step times: recent enough to follow a burst's prefill
    steps giving way to decode steps, smooth enough that one slow step does not swing it."""

    weight: float = 0.2
    """Share of the newest step in the average (about the last five steps count)."""
    seconds: float | None = None
    """The average so far; None until a step was timed."""

    def observe(self, step_s: float) -> None:
        if self.seconds is None:
            self.seconds = step_s
        else:
            self.seconds += self.weight * (step_s - self.seconds)


def retry_after_ms(num_steps: int, step_s: float | None) -> int:
    """Milliseconds until `num_steps` steps of `step_s` seconds have run: at least 1, at most
    MAX_RETRY_AFTER_MS; DEFAULT_RETRY_AFTER_MS without a step time."""
    if step_s is None:
        return DEFAULT_RETRY_AFTER_MS
    estimate = math.ceil(max(num_steps, 1) * step_s * 1000)
    return max(1, min(estimate, MAX_RETRY_AFTER_MS))
