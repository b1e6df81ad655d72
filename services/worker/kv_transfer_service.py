"""KV transfer between workers, the gRPC side (worker.proto `KvTransfer`, docs/disaggregation.md):
the decode worker's PushKv servicer, and the prefill worker's sender.

A transfer is one client stream: a header, then chunks of whole blocks (at most CHUNK_BYTES
each, so a long prompt never makes one huge message; HTTP/2 flow control paces the sender to
the receiver). Both ends carry the stack's internal secret like every internal call. The
receiver writes each chunk on its forward thread, between steps: the blocks are reserved for a
sequence it does not hold yet, so no step reads them meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import torch

from protos.llmserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.internal_auth import internal_channel
from services.contracts.step import StepResult
from services.worker import metrics
from services.worker.kv_cache import PagedKVCache
from services.worker.kv_transfer import CacheIdentity, KvInbox, OutgoingKv, fail

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name
CHUNK_BYTES = 1 << 20
PUSH_TIMEOUT_S = 60.0
"""Longest one transfer may take before the prefill side gives it up (the decode side then
prefills the prompt itself)."""

OnForwardThread = Callable[..., Awaitable[Any]]


class KvTransferServicer(worker_pb2_grpc.KvTransferServicer):
    """Decode side: writes pushed blocks into this worker's cache. `ready` gives the cache and
    its identity once the model is loaded (None before)."""

    def __init__(
        self,
        ready: Callable[[], tuple[PagedKVCache, KvInbox] | None],
        on_forward_thread: OnForwardThread,
    ) -> None:
        self._ready = ready
        self._on_forward_thread = on_forward_thread

    async def PushKv(
        self,
        request_iterator: AsyncIterator[worker_pb2.KvChunk],
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.PushKvResponse:
        ready = self._ready()
        if ready is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker: model still loading")
        assert ready is not None
        kv_cache, inbox = ready
        started = time.perf_counter()
        num_written, ok = 0, False
        try:
            num_written = await self._receive(request_iterator, context, kv_cache, inbox)
            ok = True
        finally:
            num_bytes = num_written * kv_cache.spec.bytes_per_block
            metrics.on_kv_transfer("received", num_bytes, time.perf_counter() - started, ok)
        return worker_pb2.PushKvResponse(num_blocks_written=num_written)

    async def _receive(
        self,
        request_iterator: AsyncIterator[worker_pb2.KvChunk],
        context: grpc.aio.ServicerContext,
        kv_cache: PagedKVCache,
        inbox: KvInbox,
    ) -> int:
        """Check the header, write every chunk; the blocks written (aborts on a refusal)."""
        started = time.perf_counter()
        header: worker_pb2.KvTransferHeader | None = None
        num_written = 0
        async for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "header: the first chunk must hold it"
                    )
                header = chunk.header
                mismatch = inbox.header_problem(_identity_of(header), header.worker_epoch)
                if mismatch is not None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
            if not chunk.block_ids:
                continue
            block_ids = list(chunk.block_ids)
            problem = _chunk_problem(block_ids, len(chunk.data), kv_cache)
            if problem is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            data = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
            written = await self._on_forward_thread(
                inbox.write, header.request_id, block_ids, data, kv_cache
            )
            if not written:
                await context.abort(
                    grpc.StatusCode.CANCELLED,
                    f"the decode side gave up the transfer of {header.request_id}",
                )
            num_written += len(block_ids)
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "header: the stream was empty")
        assert header is not None
        log.info(
            "kv received",
            extra={
                "request_id": header.request_id,
                "num_blocks": num_written,
                "ms": (time.perf_counter() - started) * 1000,
            },
        )
        return num_written


def _identity_of(header: worker_pb2.KvTransferHeader) -> CacheIdentity:
    return CacheIdentity(
        header.model_name,
        header.kv_cache_dtype,
        header.block_size,
        header.num_layers,
        header.num_kv_heads,
        header.head_dim,
    )


def _chunk_problem(block_ids: list[int], num_bytes: int, kv_cache: PagedKVCache) -> str | None:
    bad = [b for b in block_ids if not 0 <= b < kv_cache.num_blocks]
    if bad:
        return f"block_ids: {bad[0]} is outside this worker's {kv_cache.num_blocks} blocks"
    expected = len(block_ids) * kv_cache.spec.bytes_per_block
    if num_bytes != expected:
        return f"data: {num_bytes} bytes for {len(block_ids)} blocks, expected {expected}"
    return None


class KvSender:
    """Prefill side: pushes collected blocks to decode workers (a channel per destination,
    kept for the next transfer)."""

    def __init__(self, identity: CacheIdentity, internal_secret: str | None) -> None:
        self.identity = identity
        self.internal_secret = internal_secret
        self._stubs: dict[str, worker_pb2_grpc.KvTransferStub] = {}

    async def send_all(self, result: StepResult, outgoing: list[OutgoingKv]) -> None:
        """Push every transfer of a step, at once; one that fails fails its sequence in
        `result` (its first token does not go out)."""
        outcomes = await asyncio.gather(
            *(self._push(kv) for kv in outgoing), return_exceptions=True
        )
        for kv, outcome in zip(outgoing, outcomes, strict=True):
            num_bytes = int(kv.data.numel())
            if not isinstance(outcome, BaseException):
                metrics.on_kv_transfer("sent", num_bytes, outcome, ok=True)
            else:
                metrics.on_kv_transfer("sent", num_bytes, 0.0, ok=False)
                detail = outcome.details() if isinstance(outcome, grpc.aio.AioRpcError) else outcome
                log.warning(
                    "kv transfer failed",
                    extra={
                        "request_id": kv.request_id,
                        "worker": kv.destination.worker,
                        "error": str(detail),
                    },
                )
                fail(result, kv.request_id, str(detail))

    async def _push(self, kv: OutgoingKv) -> float:
        """Push one transfer; its seconds."""
        started = time.perf_counter()
        stub = self._stub(kv.destination.worker)
        await stub.PushKv(self._chunks(kv), timeout=PUSH_TIMEOUT_S)
        log.info(
            "kv sent",
            extra={
                "request_id": kv.request_id,
                "worker": kv.destination.worker,
                "num_blocks": kv.destination.num_blocks,
                "ms": (time.perf_counter() - started) * 1000,
            },
        )
        return time.perf_counter() - started

    def _chunks(self, kv: OutgoingKv) -> AsyncIterator[worker_pb2.KvChunk]:
        identity = self.identity
        header = worker_pb2.KvTransferHeader(
            request_id=kv.request_id,
            model_name=identity.model_name,
            kv_cache_dtype=identity.kv_cache_dtype,
            block_size=identity.block_size,
            num_layers=identity.num_layers,
            num_kv_heads=identity.num_kv_heads,
            head_dim=identity.head_dim,
            lora_name=kv.lora_name,
            cache_salt=kv.cache_salt,
            num_blocks=kv.destination.num_blocks,
            worker_epoch=kv.destination.worker_epoch,
        )
        block_ids = kv.destination.block_ids
        bytes_per_block = int(kv.data.shape[-1]) if kv.data.numel() else 1
        per_chunk = max(1, CHUNK_BYTES // bytes_per_block)

        async def generate() -> AsyncIterator[worker_pb2.KvChunk]:
            yield worker_pb2.KvChunk(header=header)
            for start in range(0, len(block_ids), per_chunk):
                rows = kv.data[start : start + per_chunk]
                yield worker_pb2.KvChunk(
                    block_ids=block_ids[start : start + per_chunk],
                    data=rows.numpy().tobytes(),
                )

        return generate()

    def _stub(self, address: str) -> worker_pb2_grpc.KvTransferStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = internal_channel(address, self.internal_secret, CHANNEL_OPTIONS)
            stub = self._stubs[address] = worker_pb2_grpc.KvTransferStub(channel)
        return stub
