"""Block pool: LRU free queue, refcounts, cached blocks that survive being freed, hashing."""

from __future__ import annotations

import hashlib
import struct

import pytest

from services.scheduler.block_pool import BlockPool, hash_block_tokens


def test_hash_is_blake2b_of_parent_and_little_endian_tokens() -> None:
    # Pinned to the byte layout: other processes (and Redis readers) recompute these hashes.
    expected = hashlib.blake2b(bytes(32) + struct.pack("<3I", 1, 2, 3), digest_size=32).digest()
    assert hash_block_tokens(None, [1, 2, 3]) == expected


def test_hash_is_chained_and_salted() -> None:
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(first, [3, 4]) == hash_block_tokens(first, [3, 4])
    assert hash_block_tokens(None, [1, 2], b"tenant-a") != hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], b"a") != hash_block_tokens(None, [1, 2], b"b")


def test_allocation_takes_the_least_recently_freed_block() -> None:
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2, 0])
    pool.free([3])
    assert pool.allocate(1) == [2]
    assert pool.allocate(2) == [0, 3]
    pool.check_integrity()


def test_refcounted_block_is_free_only_after_last_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert pool.num_free_blocks == 1 and not pool.is_free(block)
    pool.free([block])
    assert pool.num_free_blocks == 2 and pool.is_free(block)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([block])
    pool.check_integrity()


def test_over_allocation_raises_and_takes_nothing() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.allocate(4)
    assert pool.num_free_blocks == 3


def test_freed_cached_block_is_revived_by_a_hit_until_reallocated() -> None:
    pool = BlockPool(2)
    block_hash = hash_block_tokens(None, [5] * 4)
    (block,) = pool.allocate(1)
    assert pool.cache_block(block, block_hash)
    pool.free([block])
    assert pool.get_cached_block(block_hash) == block  # freed but still findable
    pool.touch([block])  # a prefix hit takes it back out of the free queue
    assert pool.ref_count(block) == 1 and not pool.is_free(block)
    pool.free([block])
    pool.allocate(2)  # reallocation evicts the hash
    assert pool.get_cached_block(block_hash) is None
    assert pool.block_hash(block) is None
    pool.check_integrity()


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    block_hash = hash_block_tokens(None, [9])
    assert pool.cache_block(first, block_hash)
    assert not pool.cache_block(second, block_hash)
    assert pool.get_cached_block(block_hash) == first
    pool.check_integrity()


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(1, enable_caching=False)
    (block,) = pool.allocate(1)
    assert not pool.cache_block(block, hash_block_tokens(None, [1]))
    assert pool.get_cached_block(hash_block_tokens(None, [1])) is None


def test_contiguous_allocation_is_first_fit_and_fails_on_fragmentation() -> None:
    pool = BlockPool(6)
    pool.allocate(6)
    pool.free([0, 2, 3, 5])  # free ids: 0, 2-3, 5
    assert pool.allocate_contiguous(3) is None  # 4 free blocks, no run of 3
    assert pool.allocate_contiguous(2) == [2, 3]
    assert pool.allocate_contiguous(1) == [0]
    pool.check_integrity()


def test_check_integrity_catches_a_referenced_block_in_the_free_queue() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool._free_queue[block] = None  # simulate a double free that skipped the refcount
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_a_stale_hash_map_entry() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool._cached[hash_block_tokens(None, [1])] = block
    with pytest.raises(AssertionError):
        pool.check_integrity()
