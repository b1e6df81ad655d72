"""The KV disk tier's step hook: cached blocks go to disk, disk blocks come back into the
pool before the forward, and a block that cannot be read fails its sequence alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import FAILED_DISK_LOAD_PREFIX, BatchPlan, DiskStore, NewSequence
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.kv_disk_steps import KvDiskSteps
from services.worker.kv_disk_tier import DiskIdentity, DiskWriter, KvDiskTier
from services.worker.kv_transfer import CacheIdentity

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
SALT = b"tenant-a"


def steps(directory: Path) -> KvDiskSteps:
    identity = DiskIdentity("model", CacheIdentity.of("m", PagedKVCache(SPEC, 1, "cpu")))
    tier = KvDiskTier(directory, 1 << 20, identity)
    tier.open()
    return KvDiskSteps(tier, DiskWriter(tier))


def new_sequence(request_id: str, block_ids: list[int]) -> NewSequence:
    return NewSequence(
        request_id,
        list(range(12)),
        12,
        block_ids,
        num_computed_tokens=8,
        sampling=SamplingParams(),
        cache_salt=SALT,
    )


def test_stored_blocks_load_back_after_a_restart(tmp_path: Path) -> None:
    source = PagedKVCache(SPEC, num_blocks=4, device="cpu")
    source.storage.copy_(
        torch.randn(source.storage.shape, generator=torch.Generator().manual_seed(1))
    )
    hashes = [b"\x01" * 32, b"\x02" * 32]
    first = steps(tmp_path)
    stores = [DiskStore(i, h, "", SALT) for i, h in enumerate(hashes)]
    plan, failed = first.admit(BatchPlan(step_id=1, disk_stores=stores), source)
    assert failed == {}
    first.close()

    restarted = steps(tmp_path)
    target = PagedKVCache(SPEC, num_blocks=4, device="cpu")
    plan = BatchPlan(
        step_id=1,
        new_sequences=[new_sequence("r", [2, 3, 0])],
        num_scheduled_tokens={"r": 4},
        disk_loads={"r": [(2, hashes[0]), (3, hashes[1])]},
    )
    admitted, failed = restarted.admit(plan, target)
    assert failed == {}
    assert admitted.num_scheduled_tokens == {"r": 4}
    assert torch.equal(target.storage[:, :, 2:4], source.storage[:, :, 0:2])


def test_a_missing_disk_block_fails_its_sequence_alone(tmp_path: Path) -> None:
    hook = steps(tmp_path)
    cache = PagedKVCache(SPEC, num_blocks=4, device="cpu")
    plan = BatchPlan(
        step_id=1,
        new_sequences=[new_sequence("gone", [0, 1, 2]), new_sequence("fine", [3])],
        num_scheduled_tokens={"gone": 4, "fine": 12},
        disk_loads={"gone": [(0, b"\x09" * 32)]},
    )
    admitted, failed = hook.admit(plan, cache)
    assert list(failed) == ["gone"]
    assert failed["gone"].startswith(FAILED_DISK_LOAD_PREFIX)
    assert [s.request_id for s in admitted.new_sequences] == ["fine"]
    assert admitted.num_scheduled_tokens == {"fine": 12}
    assert admitted.disk_loads == {}
    hook.close()


def test_a_tier_that_turned_itself_off_copies_no_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a disk error the scheduler may still name blocks to store: the step copies none
    of them out of the cache (the copy would only be dropped)."""
    hook = steps(tmp_path)
    cache = PagedKVCache(SPEC, num_blocks=4, device="cpu")
    reads: list[list[int]] = []
    real_read = cache.read_blocks
    monkeypatch.setattr(cache, "read_blocks", lambda ids: reads.append(ids) or real_read(ids))
    store = [DiskStore(0, b"\x03" * 32, "", SALT)]
    hook.admit(BatchPlan(step_id=1, disk_stores=store), cache)
    assert reads == [[0]]
    hook.tier.enabled = False
    hook.admit(BatchPlan(step_id=2, disk_stores=store), cache)
    assert reads == [[0]]
    hook.close()
