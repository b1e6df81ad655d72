"""Pinned prefixes and per-tenant cache salts in the scheduler's pure logic."""

from __future__ import annotations

from services.common.prefix_hash import hash_block_tokens, prefix_block_hashes, tenant_salt
from services.contracts.sampling_params import SamplingParams
from services.scheduler.request import Request
from tests.unit.factories import create_requests, create_scheduler, run_until_done

SYSTEM = list(range(500, 548))  # three full blocks


def pin_request(name: str, token_ids: list[int], salt: bytes = b"") -> Request:
    return Request(
        request_id=f"pin-{name}",
        prompt_token_ids=list(token_ids),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=1),
        cache_salt=salt,
    )


def test_prefix_block_hashes_chain_like_the_block_pool() -> None:
    tokens = list(range(40))
    first = hash_block_tokens(None, tokens[:16], b"s")
    second = hash_block_tokens(first, tokens[16:32])
    assert prefix_block_hashes(tokens, 16, b"s") == [first, second]
    assert prefix_block_hashes(tokens, 16, b"s", max_blocks=1) == [first]
    assert prefix_block_hashes(tokens, 16)[0] != first  # the salt changes the whole chain
    assert tenant_salt("") == b"" and tenant_salt("a") != tenant_salt("b")


def test_pinned_prefix_survives_memory_pressure_and_is_hit() -> None:
    scheduler = create_scheduler(num_blocks=12, max_pinned_fraction=0.5)
    scheduler.add_request(pin_request("sys", SYSTEM), pin_name="sys")
    run_until_done(scheduler)
    assert scheduler.pins.pinned_tokens("sys") == 48
    assert scheduler.get_stats().num_pinned_blocks == 3
    # Unrelated requests cycle every other block through the LRU free queue...
    for request in create_requests(4, num_tokens=100, max_new_tokens=4, id_prefix="fill"):
        scheduler.add_request(request)
        run_until_done(scheduler)
    # ...and the pinned blocks are still cached: a request with that system prefix hits them.
    (user,) = create_requests(1, num_tokens=60, prefix=SYSTEM, max_new_tokens=2)
    scheduler.add_request(user)
    events = run_until_done(scheduler)
    assert events["req0"][-1].num_cached_tokens == 48
    assert scheduler.pins.unpin("sys") and not scheduler.pins.unpin("sys")
    assert scheduler.pins.num_pinned_blocks == 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks
    scheduler.check_integrity()


def test_pin_beyond_the_budget_pins_nothing() -> None:
    scheduler = create_scheduler(num_blocks=20, max_pinned_fraction=0.1)  # 2 blocks
    scheduler.add_request(pin_request("big", SYSTEM), pin_name="big")
    run_until_done(scheduler)
    assert scheduler.pins.pinned_tokens("big") == 0
    assert scheduler.kv.num_free_blocks == 20


def test_an_aborted_pin_request_pins_nothing() -> None:
    scheduler = create_scheduler()
    scheduler.add_request(pin_request("sys", SYSTEM), pin_name="sys")
    scheduler.abort_request("pin-sys")
    run_until_done(scheduler)
    assert scheduler.pins.num_pinned_blocks == 0


def test_tenants_never_share_cached_blocks() -> None:
    scheduler = create_scheduler()
    a, b, a2 = create_requests(3, num_tokens=40, prefix=SYSTEM[:32], max_new_tokens=2)
    a.cache_salt, b.cache_salt, a2.cache_salt = tenant_salt("a"), tenant_salt("b"), tenant_salt("a")
    for request in (a, b, a2):
        scheduler.add_request(request)
        events = run_until_done(scheduler)
        scheduler.check_integrity()
        (cached,) = {e.num_cached_tokens for e in events[request.request_id]}
        expected = 32 if request is a2 else 0
        assert cached == expected, request.request_id
