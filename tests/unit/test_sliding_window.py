"""Blocks before a sliding window: which ones no future query sees (the policy), and the KV
manager giving them back while the request runs, through prefix hits, forks and frees."""

from __future__ import annotations

import pytest

from services.scheduler.features.sliding_window import RELEASED_BLOCK, num_dead_blocks
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from tests.unit.factories import create_requests

BS = 4
WINDOW = 6


def dead_by_definition(num_computed: int, window: int, block_size: int) -> int:
    """Leading blocks none of whose positions any query at q >= num_computed sees
    (q - window < j <= q)."""
    count = 0
    while all(
        not (q - window < j <= q)
        for j in range(count * block_size, (count + 1) * block_size)
        for q in range(num_computed, num_computed + window + block_size)
    ):
        count += 1
    return count


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 3, 4, 6, 16, 33])
def test_dead_blocks_are_those_no_later_query_sees(window: int, block_size: int) -> None:
    for num_computed in range(0, 80):
        assert num_dead_blocks(num_computed, window, block_size) == dead_by_definition(
            num_computed, window, block_size
        ), num_computed


def test_no_window_no_dead_blocks() -> None:
    assert num_dead_blocks(10_000, 0, 16) == 0


def test_the_block_holding_the_windows_first_key_stays() -> None:
    # n = 12, W = 6: the next query (position 12) sees keys 7..12; block 1 holds 4..7.
    assert num_dead_blocks(12, 6, 4) == 1
    assert num_dead_blocks(13, 6, 4) == 2  # keys 8..13: block 1 is dead now


def make_manager(num_blocks: int = 16, **kwargs: object) -> KVCacheManager:
    kwargs.setdefault("sliding_window", WINDOW)
    return KVCacheManager(num_blocks, BS, **kwargs)  # type: ignore[arg-type]


def admit_and_compute(kv: KVCacheManager, request: Request) -> list[int]:
    computed, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, computed) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return kv.get_block_table(request.request_id)


def decode(kv: KVCacheManager, request: Request, num_steps: int) -> None:
    """Steps of one token each: room for the last token, which is then computed and cached."""
    for _ in range(num_steps):
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        request.output_token_ids.append(7)
        kv.cache_full_blocks(request)
        kv.check_integrity()


def held(table: list[int]) -> list[int]:
    return [block_id for block_id in table if block_id != RELEASED_BLOCK]


def test_decoding_past_the_window_gives_leading_blocks_back() -> None:
    kv = make_manager()
    (request,) = create_requests(1, num_tokens=20)
    table = list(admit_and_compute(kv, request))
    assert kv.num_free_blocks == 11
    decode(kv, request, 1)  # allocated before the 21st token: n = 20 sees keys 15..20
    assert kv.get_block_table(request.request_id)[:4] == [RELEASED_BLOCK] * 3 + [table[3]]
    assert [kv.pool.ref_count(b) for b in table[:3]] == [0, 0, 0]
    for _ in range(40):
        decode(kv, request, 1)
        # The window's blocks and the one the next token goes into, never more.
        assert len(held(kv.get_block_table(request.request_id))) <= -(-WINDOW // BS) + 1
    kv.free(request)
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_released_blocks_stay_prefix_hits() -> None:
    """Freed to the pool, the released full blocks keep their hashes: a later request with
    the same prefix takes them back (they are evicted only when the pool needs them)."""
    kv = make_manager()
    first, second = create_requests(2, num_tokens=21, prefix=list(range(100, 120)))
    table = list(admit_and_compute(kv, first))
    decode(kv, first, 1)
    assert kv.get_block_table(first.request_id)[0] == RELEASED_BLOCK
    blocks, num_cached = kv.get_computed_blocks(second)
    assert blocks == table[:5] and num_cached == 20
    assert kv.allocate_slots(second, 1, blocks) is not None
    kv.check_integrity()
    kv.free(first)
    kv.free(second)
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_blocks_filled_and_passed_by_one_chunk_are_cached_before_release() -> None:
    """A prefill chunk longer than the window computes blocks that are dead by its end: they
    are published before they go back to the pool."""
    kv = make_manager()
    first, second = create_requests(2, num_tokens=30, prefix=list(range(100, 124)))
    table = kv.allocate_slots(first, 24)  # a chunk: tokens 0..23, not cached yet
    assert table is not None
    first.num_computed_tokens = 24
    assert kv.allocate_slots(first, 6) is not None  # the next chunk: blocks 0..3 are dead
    assert kv.get_block_table(first.request_id)[:4] == [RELEASED_BLOCK] * 4
    blocks, num_cached = kv.get_computed_blocks(second)
    assert blocks == table[:4] and num_cached == 16
    kv.check_integrity()


def test_a_released_block_shared_with_a_fork_stays_with_the_fork() -> None:
    kv = make_manager()
    (parent,) = create_requests(1, num_tokens=10)
    table = list(admit_and_compute(kv, parent))
    kv.fork(parent.request_id, "child", parent.num_computed_tokens)
    child = Request("child", list(parent.prompt_token_ids), parent.sampling)
    child.num_computed_tokens = parent.num_computed_tokens
    decode(kv, parent, 4)  # n = 10 -> 14: the parent gives back blocks 0 and 1
    assert kv.get_block_table(parent.request_id)[:2] == [RELEASED_BLOCK] * 2
    assert [kv.pool.ref_count(b) for b in table[:2]] == [1, 1]  # the child's
    decode(kv, child, 4)
    assert [kv.pool.ref_count(b) for b in table[:2]] == [0, 0]
    # A fork of a sequence with released blocks shares only the ones it holds.
    kv.fork(child.request_id, "grandchild", child.num_computed_tokens)
    assert kv.get_block_table("grandchild")[:2] == [RELEASED_BLOCK] * 2
    kv.check_integrity()
    for request_id in (parent.request_id, child.request_id, "grandchild"):
        kv.free(Request(request_id, [1]))
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_no_window_or_max_length_keeps_every_block() -> None:
    for kv in (
        make_manager(sliding_window=0),
        make_manager(allocation_policy="max_length", max_model_len=64),
    ):
        (request,) = create_requests(1, num_tokens=20, max_new_tokens=20)
        admit_and_compute(kv, request)
        decode(kv, request, 12)
        assert RELEASED_BLOCK not in kv.get_block_table(request.request_id)
        kv.free(request)
        assert kv.num_free_blocks == 16


def test_releasing_makes_room_for_the_next_block() -> None:
    """A decode that needs a new block finds it among the ones its own window let go."""
    kv = make_manager(num_blocks=5)
    (request,) = create_requests(1, num_tokens=20)
    admit_and_compute(kv, request)
    assert kv.num_free_blocks == 0
    decode(kv, request, 30)  # 50 tokens through 5 blocks
    assert request.num_computed_tokens == 50
