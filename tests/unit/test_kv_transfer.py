"""KV transfer between workers (services/worker/kv_transfer*.py): which blocks a prefill worker
copies out and when, the identity checks, and a push over a real loopback gRPC server into
another cache, byte for byte."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from protos.llmserve.v1 import worker_pb2, worker_pb2_grpc
from services.contracts.kv_transfer import ON_DISK, KvDestination, KvExport
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence, StepResult
from services.worker import kv_transfer_service, kv_transfer_shm
from services.worker.input_batch import CachedSequence
from services.worker.kv_arrivals import KvArrivals, TransferFailed
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.kv_disk_tier import BlockScope, DiskIdentity, DiskWriter, KvDiskTier
from services.worker.kv_transfer import CacheIdentity, KvInbox, KvOutbox, OutgoingKv, Transports
from services.worker.kv_transfer_service import KvSender, KvTransferServicer
from services.worker.kv_transfer_shm import host_identity

BLOCK_SIZE = 4
EPOCH = "epoch-1"
SPEC = KVCacheSpec(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK_SIZE, dtype=torch.float32
)


def filled_cache(num_blocks: int = 12, seed: int = 0) -> PagedKVCache:
    cache = PagedKVCache(SPEC, num_blocks, "cpu")
    cache.storage.copy_(
        torch.randn(cache.storage.shape, generator=torch.Generator().manual_seed(seed))
    )
    return cache


def identity(cache: PagedKVCache, model_name: str = "m") -> CacheIdentity:
    return CacheIdentity.of(model_name, cache)


def destination(first_block: int, block_ids: list[int], **overrides: Any) -> KvDestination:
    fields: dict[str, Any] = {
        "worker": "127.0.0.1:1",
        "first_block": first_block,
        "block_ids": block_ids,
        "model_name": "m",
        "kv_cache_dtype": "float32",
        "block_size": BLOCK_SIZE,
        "worker_epoch": EPOCH,
    }
    return KvDestination(**{**fields, **overrides})


def prefill_step(
    dest: KvDestination, sampled: bool
) -> tuple[BatchPlan, StepResult, dict[str, CachedSequence]]:
    """A 10-token prompt in blocks [3, 7, 5]; the step samples its first token or not."""
    seq = NewSequence("r", list(range(10)), 10, [3, 7, 5], 0, SamplingParams(), kv_destination=dest)
    plan = BatchPlan(step_id=0, new_sequences=[seq], num_scheduled_tokens={"r": 10})
    result = StepResult(step_id=0, sampled_token_ids={"r": 42} if sampled else {})
    cached = CachedSequence("r", list(range(10)), 10, [3, 7, 5], 0, SamplingParams())
    return plan, result, {"r": cached}


def test_the_prompt_blocks_after_the_decode_sides_prefix_are_copied_on_the_first_token() -> None:
    cache = filled_cache()
    outbox = KvOutbox(identity(cache))
    plan, result, sequences = prefill_step(destination(1, [9, 10]), sampled=False)
    assert outbox.collect(plan, result, sequences, cache) == []  # a partial chunk: not yet
    result.sampled_token_ids["r"] = 42
    (outgoing,) = outbox.collect(BatchPlan(step_id=1), result, sequences, cache)
    assert torch.equal(outgoing.data, cache.read_blocks([7, 5]))
    assert result.sampled_token_ids == {"r": 42}
    assert outbox.collect(BatchPlan(step_id=2), result, sequences, cache) == []  # sent once


def test_a_destination_for_another_cache_fails_the_sequence_alone() -> None:
    cache = filled_cache()
    outbox = KvOutbox(identity(cache))
    plan, result, sequences = prefill_step(destination(0, [1, 2, 3], block_size=16), sampled=True)
    assert outbox.collect(plan, result, sequences, cache) == []
    assert "r" not in result.sampled_token_ids
    assert "block size" in result.failed_sequences["r"]


def test_a_destination_with_the_wrong_number_of_blocks_is_refused() -> None:
    cache = filled_cache()
    outbox = KvOutbox(identity(cache))
    plan, result, sequences = prefill_step(destination(0, [1, 2]), sampled=True)
    assert outbox.collect(plan, result, sequences, cache) == []
    assert "2 blocks" in result.failed_sequences["r"]


def test_an_export_copies_its_cached_blocks_and_fails_alone() -> None:
    cache = filled_cache()
    outbox = KvOutbox(identity(cache))
    good = KvExport("fetch-1", [6, 2], destination(1, [9, 10], cache_salt=b"s"))
    wrong_size = KvExport("fetch-2", [6, 2], destination(0, [1, 2], block_size=16))
    too_few = KvExport("fetch-3", [6], destination(0, [1, 2]))
    plan = BatchPlan(step_id=0, kv_exports=[good, wrong_size, too_few])
    (outgoing,), failed = outbox.export(plan, cache)
    assert outgoing.request_id == "fetch-1" and outgoing.cache_salt == b"s"
    assert torch.equal(outgoing.data, cache.read_blocks([6, 2]))
    assert outgoing.destination == good.destination
    assert "block size" in failed["fetch-2"] and "1 blocks for 2" in failed["fetch-3"]
    assert outbox.export(BatchPlan(step_id=1), cache) == ([], {})


def test_an_export_reads_blocks_the_pool_evicted_from_the_disk_tier(tmp_path: Path) -> None:
    cache = filled_cache()
    on_disk = filled_cache(seed=5)  # the evicted block's contents, kept by the disk tier
    disk = KvDiskTier(tmp_path, 1 << 20, DiskIdentity("model", identity(cache)))
    disk.open()
    writer = DiskWriter(disk)
    writer.submit(b"\x01" * 32, BlockScope("", b"s"), on_disk.read_blocks([4])[0].numpy().tobytes())
    writer.close()
    outbox = KvOutbox(identity(cache))
    dest = destination(0, [9, 10, 11], cache_salt=b"s")
    export = KvExport("fetch-1", [6, ON_DISK, 2], dest, [b"\x00" * 32, b"\x01" * 32, b"\x02" * 32])
    (outgoing,), failed = outbox.export(BatchPlan(step_id=0, kv_exports=[export]), cache, disk)
    assert failed == {}
    assert torch.equal(outgoing.data[0], cache.read_blocks([6])[0])
    assert torch.equal(outgoing.data[1], on_disk.read_blocks([4])[0])
    assert torch.equal(outgoing.data[2], cache.read_blocks([2])[0])
    # Under another salt the file is not this block (another tenant's): the export fails.
    one = destination(0, [9], cache_salt=b"s")
    other = KvExport("fetch-2", [ON_DISK], destination(0, [9], cache_salt=b"t"), [b"\x01" * 32])
    gone = KvExport("fetch-3", [ON_DISK], one, [b"\x07" * 32])
    no_tier = KvExport("fetch-4", [ON_DISK], one, [b"\x01" * 32])
    outgoing, failed = outbox.export(BatchPlan(step_id=1, kv_exports=[other, gone]), cache, disk)
    assert outgoing == [] and set(failed) == {"fetch-2", "fetch-3"}
    _, failed = outbox.export(BatchPlan(step_id=2, kv_exports=[no_tier]), cache, None)
    assert "no longer on this worker's disk" in failed["fetch-4"]


def test_identity_names_the_first_field_that_differs() -> None:
    cache = filled_cache()
    other = CacheIdentity("m", "float16", BLOCK_SIZE, 2, 2, 8)
    message = identity(cache).mismatch(other)
    assert message is not None and message.startswith("kv_cache_dtype differs")
    assert identity(cache).mismatch(identity(filled_cache(seed=1))) is None


@dataclass
class Pushed:
    """How a push through a real loopback server went, seen from both ends."""

    sent: bool
    """The sender's view: the decode worker wrote it."""
    awaited: int | grpc.aio.AioRpcError
    """AwaitKv's answer: the blocks written, or the error the transfer ended with."""
    shm_name: str
    """The shared-memory file the sender made ("" = the byte stream)."""
    shm_files_left: list[str]


async def _push(
    sender_cache: PagedKVCache,
    receiver_cache: PagedKVCache,
    dest_blocks: list[int],
    receiver_model: str = "m",
    receiver_epoch: str = EPOCH,
    given_up: tuple[str, ...] = (),
    shm_dir: Path | None = None,
    receiver_shm_dir: Path | None = None,
) -> Pushed:
    """Push request "r"'s prompt from one cache into another through a real gRPC server, then
    ask the receiver (AwaitKv) as the decode scheduler does; the receiver's scheduler has given
    up the transfers of `given_up` first. With `shm_dir`, both workers report the same host and
    the blocks go through a file there (the receiver looks in `receiver_shm_dir`, by default the
    same directory)."""
    inbox = KvInbox(identity(receiver_cache, receiver_model), receiver_epoch)
    inbox.on_plan(BatchPlan(step_id=0, finished_request_ids=list(given_up)), {})
    server = grpc.aio.server()

    async def on_forward_thread(function: Any, *args: Any) -> Any:
        return await asyncio.to_thread(function, *args)

    receiver_dir = receiver_shm_dir or shm_dir
    servicer = KvTransferServicer(
        lambda: (receiver_cache, inbox), on_forward_thread, str(receiver_dir or "")
    )
    worker_pb2_grpc.add_KvTransferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    host = host_identity(str(shm_dir)) if shm_dir else ""
    try:
        transports = Transports(host)
        outbox = KvOutbox(identity(sender_cache), transports)
        dest = destination(0, dest_blocks, worker=f"127.0.0.1:{port}", host_identity=host)
        plan, result, sequences = prefill_step(dest, sampled=True)
        (outgoing,) = outbox.collect(plan, result, sequences, sender_cache)
        assert result.sampled_token_ids == {"r": 42}  # the token never waits for the push
        sender = KvSender(identity(sender_cache), None, transports)
        waiting = asyncio.create_task(_await_kv(port, receiver_epoch))
        sent = await sender.send(outgoing)
        awaited = await waiting
        left = sorted(p.name for d in {shm_dir, receiver_dir} if d for p in d.iterdir())
        return Pushed(sent, awaited, outgoing.shm_name, left)
    finally:
        await server.stop(0)


async def _await_kv(port: int, epoch: str) -> int | grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.KvTransferStub(channel)
        try:
            answer = await stub.AwaitKv(
                worker_pb2.AwaitKvRequest(request_id="r", worker_epoch=epoch), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            return exc
        return answer.num_blocks_written


TRANSPORTS = ["bytes in 1 MiB chunks", "bytes a block per chunk", "shared memory"]


def _transport(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path | None:
    if name == "bytes a block per chunk":
        monkeypatch.setattr(kv_transfer_service, "CHUNK_BYTES", SPEC.bytes_per_block)
    return tmp_path if name == "shared memory" else None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_push_writes_the_blocks_into_the_reserved_ones_byte_for_byte(
    transport: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shm_dir = _transport(transport, monkeypatch, tmp_path)
    sender, receiver = filled_cache(seed=1), PagedKVCache(SPEC, 12, "cpu")
    pushed = asyncio.run(_push(sender, receiver, [11, 0, 6], shm_dir=shm_dir))
    assert pushed.awaited == 3 and pushed.sent
    assert bool(pushed.shm_name) == (shm_dir is not None)
    assert pushed.shm_files_left == []  # the receiver deleted the file once read
    for source, target in zip([3, 7, 5], [11, 0, 6], strict=True):
        assert torch.equal(receiver.storage[:, :, target], sender.storage[:, :, source])
    untouched = [b for b in range(12) if b not in (11, 0, 6)]
    assert receiver.storage[:, :, untouched].abs().sum() == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("dest_blocks", "receiver_model", "receiver_epoch", "given_up", "reason"),
    [
        ([1, 2, 99], "m", EPOCH, (), "block_ids: 99"),
        ([1, 2, 3], "other", EPOCH, (), "model_name differs"),
        ([1, 2, 3], "m", EPOCH, ("r",), "gave up"),
    ],
)
def test_a_refused_push_writes_nothing_and_the_decode_side_hears_the_reason(
    transport: str,
    dest_blocks: list[int],
    receiver_model: str,
    receiver_epoch: str,
    given_up: tuple[str, ...],
    reason: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    shm_dir = _transport(transport, monkeypatch, tmp_path)
    sender, receiver = filled_cache(seed=1), PagedKVCache(SPEC, 12, "cpu")
    pushed = asyncio.run(
        _push(sender, receiver, dest_blocks, receiver_model, receiver_epoch, given_up, shm_dir)
    )
    assert not pushed.sent
    assert isinstance(pushed.awaited, grpc.aio.AioRpcError)
    assert reason in (pushed.awaited.details() or "")
    assert pushed.shm_files_left == []  # refused files are deleted too
    assert receiver.storage.abs().sum() == 0


def test_a_restarted_decode_worker_refuses_the_wait_and_the_push(tmp_path: Path) -> None:
    sender, receiver = filled_cache(seed=1), PagedKVCache(SPEC, 12, "cpu")
    pushed = asyncio.run(_push(sender, receiver, [1, 2, 3], "m", "epoch-2", shm_dir=tmp_path))
    assert not pushed.sent
    assert isinstance(pushed.awaited, grpc.aio.AioRpcError)
    assert pushed.awaited.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "restarted" in (pushed.awaited.details() or "")
    assert pushed.shm_files_left == [] and receiver.storage.abs().sum() == 0


def test_a_file_the_receiver_cannot_see_is_sent_as_bytes_instead(tmp_path: Path) -> None:
    # Same host identity, but the receiver looks in another directory (another mount).
    (ours := tmp_path / "ours").mkdir()
    (theirs := tmp_path / "theirs").mkdir()
    sender, receiver = filled_cache(seed=1), PagedKVCache(SPEC, 12, "cpu")
    pushed = asyncio.run(_push(sender, receiver, [11, 0, 6], shm_dir=ours, receiver_shm_dir=theirs))
    assert pushed.shm_name and pushed.sent and pushed.awaited == 3
    assert pushed.shm_files_left == []  # the sender deleted its own file
    assert torch.equal(receiver.storage[:, :, 0], sender.storage[:, :, 7])


def test_the_transport_is_shared_memory_only_on_the_same_host(tmp_path: Path) -> None:
    cache = filled_cache()
    here = host_identity(str(tmp_path))
    assert here and here.endswith(str(tmp_path))
    transports = Transports(here)
    same = destination(0, [1], host_identity=here)
    assert transports.shm_directory(same) == str(tmp_path)
    other_host = here.replace(socket.gethostname(), "elsewhere")
    assert transports.shm_directory(destination(0, [1], host_identity=other_host)) == ""
    assert transports.shm_directory(destination(0, [1])) == ""  # unknown host: bytes
    assert Transports("").shm_directory(same) == ""  # this worker has no shm directory
    transports.refused(same.worker)
    assert transports.shm_directory(same) == ""  # refused once: bytes from then on
    assert host_identity("") == "" and host_identity(str(tmp_path / "missing")) == ""
    del cache


def test_a_file_of_the_wrong_size_or_name_is_refused(tmp_path: Path) -> None:
    name, mapped = kv_transfer_shm.create(str(tmp_path), 64)
    mapped.fill_(7)
    with pytest.raises(kv_transfer_shm.SharedMemoryError, match="shm_num_bytes"):
        kv_transfer_shm.open_mapped(str(tmp_path), name, 128)
    with pytest.raises(kv_transfer_shm.SharedMemoryError, match="not a KV transfer file"):
        kv_transfer_shm.open_mapped(str(tmp_path), "../etc/passwd", 64)
    with pytest.raises(kv_transfer_shm.SharedMemoryError, match="cannot be opened"):
        kv_transfer_shm.open_mapped(str(tmp_path), kv_transfer_shm.PREFIX + "1-missing", 64)
    assert kv_transfer_shm.open_mapped(str(tmp_path), name, 64).eq(7).all()


def test_a_push_naming_a_file_of_the_wrong_size_is_refused_and_the_file_deleted(
    tmp_path: Path,
) -> None:
    async def push() -> grpc.aio.AioRpcError:
        receiver = PagedKVCache(SPEC, 12, "cpu")
        inbox = KvInbox(identity(receiver), EPOCH)
        server = grpc.aio.server()

        async def on_forward_thread(function: Any, *args: Any) -> Any:
            return function(*args)

        servicer = KvTransferServicer(lambda: (receiver, inbox), on_forward_thread, str(tmp_path))
        worker_pb2_grpc.add_KvTransferServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        name, _ = kv_transfer_shm.create(str(tmp_path), SPEC.bytes_per_block)  # one block
        kv_sender = KvSender(identity(receiver), None)
        kv = OutgoingKv(
            "r",
            destination(0, [1, 2], worker=f"127.0.0.1:{port}"),
            "",
            b"",
            torch.zeros(2, SPEC.bytes_per_block, dtype=torch.uint8),
            name,
        )
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await kv_sender._push(kv)
            assert receiver.storage.abs().sum() == 0
            return refused.value
        finally:
            await server.stop(0)

    refused = asyncio.run(push())
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "shm_num_bytes" in (refused.details() or "")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_push_deletes_its_file(tmp_path: Path) -> None:
    cache = filled_cache()
    here = host_identity(str(tmp_path))
    transports = Transports(here)
    outbox = KvOutbox(identity(cache), transports)
    dest = destination(0, [1, 2, 3], worker="127.0.0.1:1", host_identity=here)  # nobody there
    plan, result, sequences = prefill_step(dest, sampled=True)
    (outgoing,) = outbox.collect(plan, result, sequences, cache)
    assert outgoing.shm_name and len(list(tmp_path.iterdir())) == 1
    assert torch.equal(outgoing.data, cache.read_blocks([3, 7, 5]))  # straight into the file
    sent = asyncio.run(KvSender(identity(cache), None, transports).send(outgoing))
    assert not sent
    assert list(tmp_path.iterdir()) == []


def test_stale_files_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    live, _ = kv_transfer_shm.create(str(tmp_path), 8)  # this process: alive
    dead = tmp_path / f"{kv_transfer_shm.PREFIX}{_dead_pid()}-abc"
    dead.write_bytes(b"x")
    old = tmp_path / f"{kv_transfer_shm.PREFIX}{os.getpid()}-old"
    old.write_bytes(b"x")
    aged = time.time() - kv_transfer_shm.STALE_AFTER_S - 1
    os.utime(old, (aged, aged))
    garbled = tmp_path / f"{kv_transfer_shm.PREFIX}not-a-pid"
    garbled.write_bytes(b"x")
    other = tmp_path / "someone-elses-file"
    other.write_bytes(b"x")
    assert kv_transfer_shm.sweep(str(tmp_path)) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, other.name])
    assert kv_transfer_shm.sweep("") == 0


def _dead_pid() -> int:
    """A pid no process has (a child that has exited and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_copy_out_writes_what_read_blocks_reads_into_a_given_buffer() -> None:
    spec = KVCacheSpec(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        dtype=torch.int8,
        quant_group_size=4,
    )
    cache = PagedKVCache(spec, 6, "cpu")
    cache.storage.copy_(torch.randint(-100, 100, cache.storage.shape, dtype=torch.int8))
    assert cache.scales is not None
    cache.scales.copy_(torch.rand(cache.scales.shape))
    out = torch.empty(3, spec.bytes_per_block, dtype=torch.uint8)
    kv_transfer_shm.copy_out(cache, [4, 0, 2], out)
    assert torch.equal(out, cache.read_blocks([4, 0, 2]))
    with pytest.raises(ValueError, match="out: shape"):
        kv_transfer_shm.copy_out(cache, [4, 0], out)


def test_a_wait_gets_the_outcome_whichever_comes_first() -> None:
    async def run() -> None:
        arrivals = KvArrivals()
        early = asyncio.create_task(arrivals.wait("a"))
        await asyncio.sleep(0)
        arrivals.written("a", 3)
        assert await early == 3
        arrivals.written("b", 5)  # the push ended before anyone asked
        assert await arrivals.wait("b") == 5
        arrivals.failed("c", grpc.StatusCode.UNAVAILABLE, "the push broke off")
        with pytest.raises(TransferFailed, match="broke off"):
            await arrivals.wait("c")
        gave_up = asyncio.create_task(arrivals.wait("d"))
        await asyncio.sleep(0)
        gave_up.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gave_up
        assert len(arrivals) == 0  # consumed or given up: nothing kept

    asyncio.run(run())


def test_only_sequences_never_held_count_as_given_up_transfers() -> None:
    cache = filled_cache()
    inbox = KvInbox(identity(cache), EPOCH)
    held = {"done": CachedSequence("done", [1], 1, [0], 1, SamplingParams())}
    inbox.on_plan(BatchPlan(step_id=0, finished_request_ids=["done", "gone"]), held)
    data = cache.read_blocks([1])
    assert inbox.write("done", [2], data, cache)
    assert not inbox.write("gone", [3], data, cache)


def test_a_full_shm_directory_sends_that_transfer_as_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    cache = filled_cache()
    here = host_identity(str(tmp_path))
    outbox = KvOutbox(identity(cache), Transports(here))
    plan, result, sequences = prefill_step(destination(0, [1, 2, 3], host_identity=here), True)
    (outgoing,) = outbox.collect(plan, result, sequences, cache)
    assert outgoing.shm_name == ""
    assert torch.equal(outgoing.data, cache.read_blocks([3, 7, 5]))
    assert list(tmp_path.iterdir()) == []  # the half-made file is gone


@pytest.mark.parametrize(
    ("request_id", "epoch", "code", "field"),
    [
        ("", EPOCH, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        ("r", "a-previous-life", grpc.StatusCode.FAILED_PRECONDITION, "worker_epoch"),
    ],
)
def test_a_wait_without_a_request_or_for_another_epoch_is_refused(
    request_id: str, epoch: str, code: grpc.StatusCode, field: str
) -> None:
    async def wait() -> grpc.aio.AioRpcError:
        receiver = PagedKVCache(SPEC, 4, "cpu")
        inbox = KvInbox(identity(receiver), EPOCH)
        server = grpc.aio.server()

        async def on_forward_thread(function: Any, *args: Any) -> Any:
            return function(*args)

        servicer = KvTransferServicer(lambda: (receiver, inbox), on_forward_thread)
        worker_pb2_grpc.add_KvTransferServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = worker_pb2_grpc.KvTransferStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.AwaitKv(
                        worker_pb2.AwaitKvRequest(request_id=request_id, worker_epoch=epoch),
                        timeout=5,
                    )
                return refused.value
        finally:
            await server.stop(0)

    refused = asyncio.run(wait())
    assert refused.code() is code
    assert field in (refused.details() or "")
