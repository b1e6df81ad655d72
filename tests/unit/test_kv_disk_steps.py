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
from services.worker.kv_disk_tier import BlockScope, DiskIdentity, DiskWriter, KvDiskTier
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


def test_a_second_worker_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    from services.worker.kv_disk_lock import KvDiskInUseError

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    identity = CacheIdentity.of("m", PagedKVCache(SPEC, 1, "cpu"))
    first = KvDiskSteps.open(tmp_path / "kv", 0.01, model, "gguf:float32", identity)
    with pytest.raises(KvDiskInUseError, match="--kv-disk-dir"):
        KvDiskSteps.open(tmp_path / "kv", 0.01, model, "gguf:float32", identity)
    first.close()
    # The lock file is not a block: a reopened tier indexes it as nothing and keeps it.
    second = KvDiskSteps.open(tmp_path / "kv", 0.01, model, "gguf:float32", identity)
    assert second.tier.hashes() == []
    assert (tmp_path / "kv" / ".lock").exists()
    second.close()


def test_stores_hand_the_writer_views_not_bytes(tmp_path: Path) -> None:
    """The step path makes one copy (read_blocks); the bytes are written from views of it."""
    submitted: list[object] = []
    hook = steps(tmp_path)
    real_submit = hook.writer.submit
    hook.writer.submit = lambda h, s, payload: (
        submitted.append(payload),
        real_submit(h, s, payload),
    )  # type: ignore[method-assign]
    cache = PagedKVCache(SPEC, num_blocks=4, device="cpu")
    cache.storage.copy_(
        torch.randn(cache.storage.shape, generator=torch.Generator().manual_seed(3))
    )
    stores = [DiskStore(1, b"\x05" * 32, "", SALT), DiskStore(3, b"\x06" * 32, "", SALT)]
    hook.admit(BatchPlan(step_id=1, disk_stores=stores), cache)
    hook.writer.flush()
    assert all(isinstance(p, memoryview) for p in submitted)
    expected = cache.read_blocks([1, 3])
    got = [
        hook.tier.get(b"\x05" * 32, BlockScope("", SALT)),
        hook.tier.get(b"\x06" * 32, BlockScope("", SALT)),
    ]
    assert got == [expected[0].numpy().tobytes(), expected[1].numpy().tobytes()]
    hook.close()


def test_a_directory_that_cannot_be_made_turns_the_tier_off_not_the_worker(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    identity = CacheIdentity.of("m", PagedKVCache(SPEC, 1, "cpu"))
    hook = KvDiskSteps.open(model / "kv", 0.01, model, "gguf:float32", identity)  # under a file
    assert not hook.tier.enabled and hook.lock is None
    cache = PagedKVCache(SPEC, num_blocks=4, device="cpu")
    _plan, failed = hook.admit(
        BatchPlan(step_id=1, disk_stores=[DiskStore(0, b"\x07" * 32, "", SALT)]), cache
    )
    assert failed == {} and hook.tier.hashes() == []
    hook.close()
