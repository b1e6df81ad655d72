"""The decode side's TTFT split (services/scheduler/kv_handoff.py): the first decode step of a
remotely prefilled request is the first token beyond the prefill pair's, however the events
group them, and a request that ends before one is not timed."""

from __future__ import annotations

from services.contracts.step import FinishReason, TokenEvent
from services.scheduler import metrics
from services.scheduler.kv_handoff import KvHandoffs


def first_decode_count() -> float:
    value = metrics.REGISTRY.get_sample_value(
        "llmserve_disagg_ttft_seconds_count", {"phase": "first_decode"}
    )
    return value or 0.0


def handoffs() -> KvHandoffs:
    return KvHandoffs("127.0.0.1:1", None, 1.0, lambda: None)


def test_the_first_decode_step_is_the_first_token_after_the_prefill_pairs() -> None:
    before = first_decode_count()
    h = handoffs()
    h._in_place_at["a"] = (0.0, 1)  # the prefill pair's one token comes out first
    h._in_place_at["b"] = (0.0, 1)
    h.on_events([TokenEvent("a", [5]), TokenEvent("other", [1])])
    assert first_decode_count() == before  # only the remote token so far
    h.on_events([TokenEvent("a", [6]), TokenEvent("b", [5, 6])])  # b: both in one event
    assert first_decode_count() == before + 2
    assert h._in_place_at == {}
    h.on_events([TokenEvent("a", [7])])
    assert first_decode_count() == before + 2  # timed once


def test_a_request_that_ends_on_the_remote_token_is_not_timed() -> None:
    before = first_decode_count()
    h = handoffs()
    h._in_place_at["a"] = (0.0, 1)
    h.on_events([TokenEvent("a", [5], finish_reason=FinishReason.LENGTH)])
    assert h._in_place_at == {} and first_decode_count() == before
    h._in_place_at["b"] = (0.0, 1)
    h.forget("b")
    assert h._in_place_at == {}
