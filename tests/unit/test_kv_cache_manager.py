"""KV cache manager: prefix hits, growth, watermark, copy-on-write, the max-length policy."""

from __future__ import annotations

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from tests.unit.factories import create_requests

BS = 4  # small blocks keep the arithmetic readable


def make_manager(num_blocks: int = 16, **kwargs: object) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, **kwargs)  # type: ignore[arg-type]


def admit_and_compute(kv: KVCacheManager, request: Request) -> list[int]:
    """Allocate a whole prompt (after any prefix hit), mark it computed, cache its blocks."""
    computed, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, computed) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return kv.get_block_table(request.request_id)


def test_second_request_hits_the_shared_full_blocks() -> None:
    kv = make_manager()
    first, second = create_requests(2, num_tokens=10, prefix=list(range(100, 108)))
    first_table = admit_and_compute(kv, first)
    blocks, num_cached = kv.get_computed_blocks(second)
    assert blocks == first_table[:2] and num_cached == 8
    kv.allocate_slots(second, second.num_tokens - num_cached, blocks)
    assert kv.get_block_table(second.request_id)[:2] == first_table[:2]
    assert [kv.pool.ref_count(b) for b in first_table] == [2, 2, 1]
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (20, 8)
    kv.check_integrity()


def test_fully_cached_prompt_recomputes_its_last_block() -> None:
    kv = make_manager()
    (request,) = create_requests(1, num_tokens=8)
    admit_and_compute(kv, request)
    kv.free(request)
    (again,) = create_requests(1, num_tokens=8)
    blocks, num_cached = kv.get_computed_blocks(again)
    assert len(blocks) == 1 and num_cached == 4  # 8 tokens cached, only 4 reused


def test_partial_block_is_not_cached() -> None:
    kv = make_manager()
    (request,) = create_requests(1, num_tokens=6)
    admit_and_compute(kv, request)
    table = kv.get_block_table(request.request_id)
    assert kv.pool.block_hash(table[0]) is not None
    assert kv.pool.block_hash(table[1]) is None


def test_uncomputed_block_is_not_cached() -> None:
    kv = make_manager()
    (request,) = create_requests(1, num_tokens=12)
    kv.allocate_slots(request, 12, [])
    request.num_computed_tokens = 5  # a prefill chunk of 5 tokens: only block 0 is done
    kv.cache_full_blocks(request)
    table = kv.get_block_table(request.request_id)
    assert [kv.pool.block_hash(b) is not None for b in table] == [True, False, False]


def test_freed_blocks_stay_hit_able_then_get_evicted() -> None:
    kv = make_manager(num_blocks=3)
    first, other = create_requests(2, num_tokens=9)
    admit_and_compute(kv, first)
    kv.free(first)
    (again,) = create_requests(1, num_tokens=9)
    assert kv.get_computed_blocks(again)[1] == 8
    kv.allocate_slots(other, 9, [])  # needs all 3 blocks: evicts the cached ones
    assert kv.get_computed_blocks(again)[1] == 0
    kv.check_integrity()


def test_allocate_returns_none_when_it_does_not_fit() -> None:
    kv = make_manager(num_blocks=4)
    big, small = create_requests(2, num_tokens=[13, 4])
    assert kv.allocate_slots(big, 13, []) is not None
    assert kv.allocate_slots(small, 4, []) is None
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_watermark_blocks_admission_but_not_growth() -> None:
    kv = make_manager(num_blocks=10, watermark=0.2)  # 2 blocks of headroom
    first, second = create_requests(2, num_tokens=[32, 4])
    assert kv.allocate_slots(first, 32, []) is not None  # 8 blocks, 2 left
    first.num_computed_tokens = 32
    assert kv.allocate_slots(second, 4, []) is None  # would leave 1 < 2
    assert kv.allocate_slots(first, 4, []) is not None  # growth may dip into the headroom
    assert kv.num_free_blocks == 1


def test_revived_cached_blocks_count_against_free_capacity() -> None:
    kv = make_manager(num_blocks=3)
    (first,) = create_requests(1, num_tokens=9)
    admit_and_compute(kv, first)
    kv.free(first)  # 3 free blocks, 2 of them cached
    (again,) = create_requests(1, num_tokens=9)
    computed, num_cached = kv.get_computed_blocks(again)
    # 2 revived + 1 new = 3 blocks: fits exactly; a 4th would not.
    assert kv.allocate_slots(again, 9 - num_cached, computed) is not None
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_fork_shares_blocks_and_copies_on_write() -> None:
    kv = make_manager()
    (parent,) = create_requests(1, num_tokens=6)
    parent_table = list(admit_and_compute(kv, parent))
    child = Request("child", list(parent.prompt_token_ids), num_computed_tokens=6)
    kv.fork(parent.request_id, "child")
    assert [kv.pool.ref_count(b) for b in parent_table] == [2, 2]
    kv.check_integrity()

    # The child appends token 7 into the shared, half-full second block.
    child.output_token_ids.append(7)
    assert kv.allocate_slots(child, 1) == []
    child_table = kv.get_block_table("child")
    assert child_table[0] == parent_table[0] and child_table[1] != parent_table[1]
    assert kv.take_pending_copies() == [(parent_table[1], child_table[1])]
    assert kv.take_pending_copies() == []
    assert [kv.pool.ref_count(b) for b in parent_table] == [2, 1]

    # Now the parent owns its block alone: appending needs no copy.
    parent.output_token_ids.append(8)
    assert kv.allocate_slots(parent, 1) == []
    assert kv.take_pending_copies() == []
    kv.check_integrity()
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 16
    kv.check_integrity()


def test_copy_on_write_that_does_not_fit_changes_nothing() -> None:
    kv = make_manager(num_blocks=2)
    (parent,) = create_requests(1, num_tokens=6)
    admit_and_compute(kv, parent)
    child = Request("child", list(parent.prompt_token_ids), num_computed_tokens=6)
    kv.fork(parent.request_id, "child")
    child.output_token_ids.append(7)
    assert kv.allocate_slots(child, 1) is None
    assert kv.take_pending_copies() == []
    kv.check_integrity()


def test_max_length_reserves_worst_case_and_never_grows() -> None:
    kv = make_manager(num_blocks=16, allocation_policy="max_length", max_model_len=64)
    (request,) = create_requests(1, num_tokens=5, max_new_tokens=20)
    blocks = kv.allocate_slots(request, 5, [])
    assert blocks == list(range(7))  # ceil(25 / 4) contiguous blocks from the start
    request.num_computed_tokens = 5
    request.output_token_ids.append(7)
    assert kv.allocate_slots(request, 1) == []
    assert kv.get_computed_blocks(request) == ([], 0)  # no prefix caching in this mode
    kv.check_integrity()


def test_max_length_suffers_external_fragmentation() -> None:
    kv = make_manager(num_blocks=12, allocation_policy="max_length")
    a, b, c, d = create_requests(4, num_tokens=4, max_new_tokens=8)  # 3 blocks each
    for request in (a, b, c, d):
        assert kv.allocate_slots(request, 4, []) is not None
    kv.free(a)
    kv.free(c)
    (wide,) = create_requests(1, num_tokens=4, max_new_tokens=16, id_prefix="wide")
    assert kv.num_free_blocks == 6
    assert kv.allocate_slots(wide, 4, []) is None  # needs 5 contiguous; runs are 3 and 3
    paged = make_manager(num_blocks=6)
    assert paged.allocate_slots(wide, 20, []) is not None  # paging uses any 5 blocks
