"""Where one disaggregated document's KV transfer spends its time (docs/disaggregation.md,
Transport): copy-out, serialization, the gRPC push over loopback, the write-in, and the same
blocks through a shared-memory file. One run, the embedded model's cache shape (SmolLM2-135M:
30 layers, 3 KV heads of 64, fp16), 2048 tokens; noisy, for orders of magnitude only.

    PYTHONPATH=. python scripts/profile_kv_transfer.py [--threads 1] [--shm]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import torch

from protos.llmserve.v1 import worker_pb2, worker_pb2_grpc
from services.contracts.kv_transfer import KvDestination
from services.contracts.sampling_params import SamplingParams
from services.worker.input_batch import CachedSequence
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.kv_transfer import CacheIdentity, KvInbox, KvOutbox, Transports
from services.worker.kv_transfer_service import KvSender, KvTransferServicer
from services.worker.kv_transfer_shm import copy_out, host_identity

SHM_DIR = "/dev/shm"
TOKENS = 2048
BLOCK_SIZE = 16
SEQUENCE = CachedSequence(
    "r",
    [0] * TOKENS,
    TOKENS,
    list(range(0, TOKENS // BLOCK_SIZE * 2, 2)),
    TOKENS,
    SamplingParams(),
)


def timed(label: str, function: Any, *args: Any) -> Any:
    started = time.perf_counter()
    value = function(*args)
    print(f"{label:<40} {(time.perf_counter() - started) * 1000:8.1f} ms")
    return value


async def push(
    sender: PagedKVCache, receiver: PagedKVCache, blocks: list[int], shm: bool, step_ms: float
) -> None:
    """Push over loopback into a receiver whose forward thread runs a step of `step_ms` back
    to back (a decode worker whose scheduler keeps one plan queued), as a busy worker's does."""
    identity = CacheIdentity.of("m", sender)
    inbox = KvInbox(identity, "e")
    server = grpc.aio.server()
    shm_dir = SHM_DIR if shm else ""
    host = host_identity(shm_dir)
    forward_thread = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.get_running_loop()

    async def on_forward_thread(function: Any, *args: Any) -> Any:
        return await loop.run_in_executor(forward_thread, function, *args)

    step_ends: list[float] = []
    a = torch.randn(256, 256)
    repeats = max(1, int(step_ms / 0.5))  # ~0.5 ms a product on one thread, roughly

    def step() -> None:
        for _ in range(repeats):
            torch.mm(a, a)
        step_ends.append(time.perf_counter())

    async def steps() -> None:
        while step_ms:
            await loop.run_in_executor(forward_thread, step)

    stepping = asyncio.create_task(steps())

    worker_pb2_grpc.add_KvTransferServicer_to_server(
        KvTransferServicer(lambda: (receiver, inbox), on_forward_thread, shm_dir), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    destination = KvDestination(
        f"127.0.0.1:{port}",
        0,
        blocks,
        "m",
        identity.kv_cache_dtype,
        identity.block_size,
        worker_epoch="e",
        host_identity=host,
    )
    transports = Transports(host)
    started = time.perf_counter()
    kv = KvOutbox(identity, transports)._copy_out("r", destination, {"r": SEQUENCE}, sender)
    print(
        f"{'copy-out into ' + ('the shm file' if shm else 'a tensor'):<40}"
        f" {(time.perf_counter() - started) * 1000:8.1f} ms"
    )
    kv_sender = KvSender(identity, None, transports)
    await asyncio.sleep(0.5)  # steps before the push: the baseline step gap
    started = time.perf_counter()
    assert await kv_sender.send(kv)
    ended = time.perf_counter()
    await asyncio.sleep(0.2)
    gaps = [(b - a_, b) for a_, b in itertools.pairwise(step_ends)]
    before = sorted(g for g, end in gaps if end < started)
    during = [g for g, end in gaps if started <= end <= ended + 0.05]
    if before and during:
        print(
            f"{'  decode step gap: median before, max during':<40}"
            f" {before[len(before) // 2] * 1000:8.1f} ms {max(during) * 1000:8.1f} ms"
        )
    label = "push, shared memory" if shm else "push, gRPC byte stream"
    label += f", decode steps of {step_ms:g} ms"
    print(f"{label:<40} {(ended - started) * 1000:8.1f} ms")
    stepping.cancel()
    await server.stop(0)
    forward_thread.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shm", action="store_true", help="also time the shared-memory push")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = KVCacheSpec(
        num_layers=30, num_kv_heads=3, head_dim=64, block_size=BLOCK_SIZE, dtype=torch.float16
    )
    num_blocks = TOKENS // spec.block_size
    sender = PagedKVCache(spec, num_blocks * 2, "cpu")
    sender.storage.normal_()
    receiver = PagedKVCache(spec, num_blocks * 2, "cpu")
    blocks = list(range(0, num_blocks * 2, 2))  # scattered, as a pool hands them out
    print(f"{num_blocks} blocks, {num_blocks * spec.bytes_per_block / 2**20:.1f} MiB")
    timed("copy-out (read_blocks), first", sender.read_blocks, blocks)
    data = timed("copy-out (read_blocks), again", sender.read_blocks, blocks)
    out = torch.empty_like(data)
    timed("copy-out (copy_out, per block)", copy_out, sender, blocks, out)
    per_chunk = (1 << 20) // spec.bytes_per_block

    def serialize() -> list[bytes]:
        return [
            worker_pb2.KvChunk(
                block_ids=blocks[s : s + per_chunk], data=data[s : s + per_chunk].numpy().tobytes()
            ).SerializeToString()
            for s in range(0, num_blocks, per_chunk)
        ]

    messages = timed("serialize (tobytes + protobuf)", serialize)

    def parse() -> None:
        for message in messages:
            chunk = worker_pb2.KvChunk.FromString(message)
            torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)

    timed("parse (protobuf + bytearray)", parse)
    timed("write-in (write_blocks)", receiver.write_blocks, blocks, data)
    for shm in (False, True) if args.shm else (False,):
        for step_ms in (0.0, 25.0):
            asyncio.run(push(sender, receiver, blocks, shm, step_ms))


if __name__ == "__main__":
    main()
