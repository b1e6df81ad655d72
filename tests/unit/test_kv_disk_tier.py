"""The KV disk tier: block files that survive a restart, refused when they do not check."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from services.worker import metrics
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.kv_disk_tier import (
    BlockScope,
    DiskIdentity,
    DiskWriter,
    KvDiskTier,
    model_fingerprint,
)
from services.worker.kv_transfer import CacheIdentity

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
TENANT_A = BlockScope("", b"tenant-a")
TENANT_B = BlockScope("", b"tenant-b")


def filled_cache(spec: KVCacheSpec = SPEC, seed: int = 0) -> PagedKVCache:
    cache = PagedKVCache(spec, num_blocks=4, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=generator))
    return cache


def identity(fingerprint: str = "model-a", spec: KVCacheSpec = SPEC) -> DiskIdentity:
    return DiskIdentity(fingerprint, CacheIdentity.of("m", PagedKVCache(spec, 1, "cpu")))


def tier(directory: Path, capacity: int = 1 << 20, **kwargs: object) -> KvDiskTier:
    disk = KvDiskTier(directory, capacity, identity(**kwargs))  # type: ignore[arg-type]
    disk.open()
    return disk


def block_bytes(cache: PagedKVCache, block_id: int) -> bytes:
    return cache.read_blocks([block_id])[0].numpy().tobytes()


def write(disk: KvDiskTier, cache: PagedKVCache, hashes: list[bytes], scope: BlockScope) -> None:
    writer = DiskWriter(disk)
    for block_id, block_hash in enumerate(hashes):
        writer.submit(block_hash, scope, block_bytes(cache, block_id))
    writer.close()


def test_blocks_survive_a_restart_and_load_back_bit_identical(tmp_path: Path) -> None:
    source = filled_cache()
    hashes = [bytes([i]) * 32 for i in range(3)]
    written_before = metrics.KV_DISK_BLOCKS.labels("written")._value.get()
    write(tier(tmp_path), source, hashes, TENANT_A)
    assert metrics.KV_DISK_BLOCKS.labels("written")._value.get() == written_before + 3

    restarted = tier(tmp_path)  # a new worker on the same directory
    assert restarted.hashes() == hashes
    target = PagedKVCache(SPEC, num_blocks=4, device="cpu")
    for block_id, block_hash in enumerate(hashes):
        payload = restarted.get(block_hash, TENANT_A)
        assert payload is not None
        target.write_blocks([block_id], torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert torch.equal(target.storage[:, :, :3], source.storage[:, :, :3])


def test_a_corrupted_block_is_deleted_at_start(tmp_path: Path) -> None:
    hashes = [b"\x01" * 32, b"\x02" * 32]
    write(tier(tmp_path), filled_cache(), hashes, TENANT_A)
    path = tmp_path / hashes[0].hex()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))

    restarted = tier(tmp_path)
    assert restarted.hashes() == [hashes[1]]
    assert not path.exists()


@pytest.mark.parametrize(
    "other",
    [
        {"fingerprint": "model-b"},
        {"spec": KVCacheSpec(2, 2, 8, 4, torch.bfloat16)},
        {"spec": KVCacheSpec(2, 2, 8, 8, torch.float32)},
    ],
    ids=["other-model", "other-kv-dtype", "other-block-size"],
)
def test_blocks_of_another_model_or_cache_are_deleted(
    tmp_path: Path, other: dict[str, object]
) -> None:
    block_hash = b"\x03" * 32
    write(tier(tmp_path), filled_cache(), [block_hash], TENANT_A)
    assert (tmp_path / block_hash.hex()).exists()
    assert tier(tmp_path, **other).hashes() == []
    assert not (tmp_path / block_hash.hex()).exists()


def test_a_block_is_never_served_under_another_tenant(tmp_path: Path) -> None:
    block_hash = b"\x04" * 32
    disk = tier(tmp_path)
    write(disk, filled_cache(), [block_hash], TENANT_A)
    assert disk.get(block_hash, TENANT_B) is None
    assert not disk.contains(block_hash)


def test_least_recently_used_blocks_go_first_when_bytes_run_out(tmp_path: Path) -> None:
    cache = filled_cache()
    first = tier(tmp_path)
    write(first, cache, [b"\x05" * 32], TENANT_A)
    file_size = first.num_bytes
    disk = tier(tmp_path, capacity=2 * file_size)
    write(disk, cache, [b"\x05" * 32, b"\x06" * 32], TENANT_A)
    assert disk.get(b"\x05" * 32, TENANT_A) is not None  # now the most recently used
    write(disk, cache, [b"\x07" * 32], TENANT_A)
    assert disk.hashes() == [b"\x05" * 32, b"\x07" * 32]
    assert disk.num_bytes <= 2 * file_size
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(h.hex() for h in disk.hashes())
    added, evicted = disk.take_changes()
    assert evicted == [b"\x06" * 32]
    assert added == [b"\x07" * 32]  # the net change: 0x06 came and went


def test_half_written_files_are_removed_at_start(tmp_path: Path) -> None:
    (tmp_path / f"{'ab' * 32}.123.tmp").write_bytes(b"LLMKVD01 half")
    assert tier(tmp_path).hashes() == []
    assert list(tmp_path.iterdir()) == []


def test_a_vanished_directory_turns_the_tier_off_without_failing(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    disk = tier(directory)
    write(disk, filled_cache(), [b"\x08" * 32], TENANT_A)
    shutil.rmtree(directory)
    errors_before = metrics.KV_DISK_ERRORS.labels("write")._value.get()
    write(disk, filled_cache(), [b"\x09" * 32], TENANT_A)
    assert not disk.enabled
    assert metrics.KV_DISK_ERRORS.labels("write")._value.get() == errors_before + 1
    assert disk.get(b"\x08" * 32, TENANT_A) is None


def test_model_fingerprint_tells_files_apart(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + b"\x00" * 100)
    b.write_bytes(b"GGUF" + b"\x01" * 100)
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a) == model_fingerprint(a)


def test_kv_disk_gib_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--kv-disk-gib"):
        WorkerConfig(kv_disk_gib=0)
