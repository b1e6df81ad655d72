"""Whether fetching a prefix's KV from another pair beats computing it here (docs/prefix-cache.md,
Prefix fetch), judged from what both have cost lately on this scheduler: seconds per token of
its own prefill steps, and of its completed fetches (call, copy-out and push included). Pure.

Until both are measured every fetch is tried. While fetching measures dearer, one fetch in
`PROBE_EVERY` is still tried, so a rate that improved (an idle exporter, a warm page cache)
is seen again.
"""

from __future__ import annotations

PROBE_EVERY = 16
MIN_PREFILL_TOKENS = 64
"""Steps computing fewer tokens say little about the prefill rate (a decode step's cost is
mostly reading the weights)."""
SMOOTHING = 0.2
"""Weight of the newest measurement in each moving average."""


class FetchCost:
    def __init__(self) -> None:
        self.prefill_s_per_token: float | None = None
        self.fetch_s_per_token: float | None = None
        self._num_declined = 0

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_s_per_token = _average(self.prefill_s_per_token, seconds / num_tokens)

    def observe_fetch(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.fetch_s_per_token = _average(self.fetch_s_per_token, seconds / num_tokens)

    def worth_fetching(self) -> bool:
        prefill, fetch = self.prefill_s_per_token, self.fetch_s_per_token
        if prefill is None or fetch is None or fetch < prefill:
            return True
        self._num_declined += 1
        return self._num_declined % PROBE_EVERY == 0


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
