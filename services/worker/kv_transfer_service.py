"""KV transfer between workers, the gRPC side (worker.proto `KvTransfer`, docs/disaggregation.md):
the decode worker's PushKv / AwaitKv servicer, and the prefill worker's sender.

A transfer is one client stream: a header, then either the name of a shared-memory file
holding every block (both workers on one host, kv_transfer_shm.py) or chunks of whole blocks
(at most CHUNK_BYTES each, so a long prompt never makes one huge message; HTTP/2 flow control
paces the sender to the receiver). Both ends carry the stack's internal secret like every
internal call. The receiver gathers the chunks off its forward thread and writes the whole
transfer there in one go, between two steps: the blocks are reserved for a sequence it does
not hold yet, so no step reads them meanwhile, and a busy worker's transfer waits for one step
boundary, not one per chunk (measured: 64 chunks behind 25 ms steps took 1.7 s).

The sender runs beside the step results, never in front of them: the decode scheduler learns
that the KV is in place from its own worker (AwaitKv), not from the first token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import torch

from protos.llmserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.internal_auth import internal_channel
from services.worker import kv_transfer_shm, metrics
from services.worker.kv_arrivals import KvArrivals, TransferFailed
from services.worker.kv_cache import PagedKVCache
from services.worker.kv_transfer import CacheIdentity, KvInbox, OutgoingKv, Transports

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name
CHUNK_BYTES = 1 << 20
PUSH_TIMEOUT_S = 60.0
"""Longest one transfer may take before the prefill side gives it up (the decode side then
prefills the prompt itself)."""

OnForwardThread = Callable[..., Awaitable[Any]]


class Refusal(Exception):
    """A push this worker will not write; `code` is its gRPC status. `retry_as_bytes`: the
    sender's shared-memory file is not visible here (another mount after all), the sender
    sends the bytes instead, so the transfer has not failed yet."""

    def __init__(
        self, code: grpc.StatusCode, message: str, *, retry_as_bytes: bool = False
    ) -> None:
        super().__init__(message)
        self.code = code
        self.retry_as_bytes = retry_as_bytes


class KvTransferServicer(worker_pb2_grpc.KvTransferServicer):
    """Decode side: writes pushed blocks into this worker's cache and tells AwaitKv when they
    are. `ready` gives the cache and its inbox once the model is loaded (None before);
    `shm_directory` is where a same-host sender's files are (empty = none accepted)."""

    def __init__(
        self,
        ready: Callable[[], tuple[PagedKVCache, KvInbox] | None],
        on_forward_thread: OnForwardThread,
        shm_directory: str = "",
    ) -> None:
        self._ready = ready
        self._on_forward_thread = on_forward_thread
        self.shm_directory = shm_directory
        self.arrivals = KvArrivals()

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
        transfer = _Transfer()
        try:
            await self._receive(request_iterator, kv_cache, inbox, transfer)
        except Refusal as refusal:
            if transfer.request_id and not refusal.retry_as_bytes:
                self.arrivals.failed(transfer.request_id, refusal.code, str(refusal))
            await context.abort(refusal.code, str(refusal))
        except BaseException:  # the stream broke off (sender gone, cancelled)
            if transfer.request_id:
                self.arrivals.failed(
                    transfer.request_id, grpc.StatusCode.UNAVAILABLE, "the push broke off"
                )
            raise
        finally:
            seconds = time.perf_counter() - started
            num_bytes = transfer.num_written * kv_cache.spec.bytes_per_block
            metrics.on_kv_transfer("received", num_bytes, seconds, transfer.done, transfer.shm)
        self.arrivals.written(transfer.request_id, transfer.num_written)
        log.info(
            "kv received",
            extra={
                "request_id": transfer.request_id,
                "num_blocks": transfer.num_written,
                "shm": transfer.shm,
                "ms": (time.perf_counter() - started) * 1000,
            },
        )
        return worker_pb2.PushKvResponse(num_blocks_written=transfer.num_written)

    async def AwaitKv(
        self, request: worker_pb2.AwaitKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushKvResponse:
        ready = self._ready()
        if ready is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker: model still loading")
        assert ready is not None
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: is empty")
        problem = ready[1].epoch_problem(request.worker_epoch)
        if problem is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        try:
            num_blocks = await self.arrivals.wait(request.request_id)
        except TransferFailed as exc:
            await context.abort(exc.code, f"the transfer failed: {exc}")
        return worker_pb2.PushKvResponse(num_blocks_written=num_blocks)

    async def _receive(
        self,
        request_iterator: AsyncIterator[worker_pb2.KvChunk],
        kv_cache: PagedKVCache,
        inbox: KvInbox,
        transfer: _Transfer,
    ) -> None:
        """Check the header, gather the blocks, write them all on the forward thread."""
        header: worker_pb2.KvTransferHeader | None = None
        block_ids: list[int] = []
        data: torch.Tensor | None = None
        bytes_per_block = kv_cache.spec.bytes_per_block
        async for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    raise Refusal(
                        grpc.StatusCode.INVALID_ARGUMENT, "header: the first chunk must hold it"
                    )
                header = chunk.header
                transfer.request_id = header.request_id
                mismatch = inbox.header_problem(_identity_of(header), header.worker_epoch)
                if mismatch is not None:
                    raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
                if header.num_blocks > kv_cache.num_blocks:
                    raise Refusal(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"num_blocks: {header.num_blocks} is more than this worker's"
                        f" {kv_cache.num_blocks}",
                    )
                if chunk.shm_name:
                    transfer.shm = True
                    await self._receive_shm(chunk, kv_cache, inbox, transfer)
                    return
                data = torch.empty((header.num_blocks, bytes_per_block), dtype=torch.uint8)
            if not chunk.block_ids:
                continue
            ids = list(chunk.block_ids)
            problem = _chunk_problem(ids, len(chunk.data), kv_cache)
            if problem is None and len(block_ids) + len(ids) > header.num_blocks:
                problem = f"block_ids: more than the header's {header.num_blocks} blocks"
            if problem is not None:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, problem)
            assert data is not None
            rows = data[len(block_ids) : len(block_ids) + len(ids)]
            rows.view(-1).numpy()[:] = np.frombuffer(chunk.data, dtype=np.uint8)
            block_ids.extend(ids)
        if header is None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "header: the stream was empty")
        if len(block_ids) != header.num_blocks:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block_ids: {len(block_ids)} blocks came, the header says {header.num_blocks}",
            )
        assert data is not None
        await self._write(header.request_id, block_ids, data, kv_cache, inbox, transfer)

    async def _receive_shm(
        self,
        chunk: worker_pb2.KvChunk,
        kv_cache: PagedKVCache,
        inbox: KvInbox,
        transfer: _Transfer,
    ) -> None:
        """The whole transfer in a shared-memory file: map, write, delete (whatever happens)."""
        name = chunk.shm_name
        try:
            if not self.shm_directory:
                raise _shm_unreadable("shm_name: this worker takes no shared-memory transfers")
            block_ids = list(chunk.block_ids)
            expected = len(block_ids) * kv_cache.spec.bytes_per_block
            problem = _chunk_problem(block_ids, expected, kv_cache)
            if problem is None and len(block_ids) != chunk.header.num_blocks:
                problem = f"block_ids: {len(block_ids)}, the header says {chunk.header.num_blocks}"
            if problem is None and chunk.shm_num_bytes != expected:
                problem = (
                    f"shm_num_bytes: {chunk.shm_num_bytes} for {len(block_ids)} blocks,"
                    f" expected {expected}"
                )
            if problem is not None:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, problem)
            try:
                mapped = kv_transfer_shm.open_mapped(self.shm_directory, name, expected)
            except kv_transfer_shm.SharedMemoryError as exc:
                if "cannot be opened" in str(exc):
                    raise _shm_unreadable(str(exc)) from exc
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
            await asyncio.to_thread(kv_transfer_shm.prefault, mapped)  # off the forward thread
            data = mapped.view(len(block_ids), kv_cache.spec.bytes_per_block)
            await self._write(chunk.header.request_id, block_ids, data, kv_cache, inbox, transfer)
        finally:
            if self.shm_directory:
                kv_transfer_shm.remove(self.shm_directory, name)

    async def _write(
        self,
        request_id: str,
        block_ids: list[int],
        data: torch.Tensor,
        kv_cache: PagedKVCache,
        inbox: KvInbox,
        transfer: _Transfer,
    ) -> None:
        if block_ids:
            written = await self._on_forward_thread(
                inbox.write, request_id, block_ids, data, kv_cache
            )
            if not written:
                raise Refusal(
                    grpc.StatusCode.CANCELLED,
                    f"the decode side gave up the transfer of {request_id}",
                )
        transfer.num_written = len(block_ids)
        transfer.done = True


class _Transfer:
    """What one push has done so far (for its metrics and its outcome)."""

    __slots__ = ("done", "num_written", "request_id", "shm")

    def __init__(self) -> None:
        self.request_id = ""
        self.num_written = 0
        self.shm = False
        self.done = False


def _shm_unreadable(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.FAILED_PRECONDITION, message, retry_as_bytes=True)


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
    """Prefill side: pushes collected blocks to decode workers in the background (a channel
    per destination, kept for the next transfer). A push that fails is logged and counted; the
    decode side, hearing it from its worker or timing out, prefills the prompt itself."""

    def __init__(
        self,
        identity: CacheIdentity,
        internal_secret: str | None,
        transports: Transports | None = None,
    ) -> None:
        self.identity = identity
        self.internal_secret = internal_secret
        self.transports = transports or Transports("")
        self._stubs: dict[str, worker_pb2_grpc.KvTransferStub] = {}
        self._pushes: set[asyncio.Task[bool]] = set()

    def start(self, outgoing: list[OutgoingKv]) -> None:
        """Push every transfer of a step without waiting for any."""
        for kv in outgoing:
            task = asyncio.create_task(self.send(kv))
            self._pushes.add(task)
            task.add_done_callback(self._pushes.discard)

    async def drain(self) -> None:
        """Wait for every push under way (tests, shutdown)."""
        while self._pushes:
            await asyncio.gather(*self._pushes, return_exceptions=True)

    async def send(self, kv: OutgoingKv) -> bool:
        """Push one transfer; whether the decode worker wrote it."""
        started = time.perf_counter()
        num_bytes = int(kv.data.numel())
        try:
            shm = await self._push(kv)
        except (grpc.aio.AioRpcError, OSError) as exc:
            metrics.on_kv_transfer("sent", num_bytes, 0.0, ok=False)
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc
            log.warning(
                "kv transfer failed",
                extra={
                    "request_id": kv.request_id,
                    "worker": kv.destination.worker,
                    "error": str(detail),
                },
            )
            return False
        finally:
            if kv.shm_name:  # read and deleted by the receiver, or never to be
                directory = kv_transfer_shm.directory_of(self.transports.host_identity)
                kv_transfer_shm.remove(directory, kv.shm_name)
        seconds = time.perf_counter() - started
        metrics.on_kv_transfer("sent", num_bytes, seconds, ok=True, shm=shm)
        log.info(
            "kv sent",
            extra={
                "request_id": kv.request_id,
                "worker": kv.destination.worker,
                "num_blocks": kv.destination.num_blocks,
                "shm": shm,
                "ms": seconds * 1000,
            },
        )
        return True

    async def _push(self, kv: OutgoingKv) -> bool:
        """Push one transfer; whether it went through shared memory."""
        stub = self._stub(kv.destination.worker)
        if kv.shm_name:
            try:
                await stub.PushKv(self._shm_message(kv), timeout=PUSH_TIMEOUT_S)
                return True
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION or not (
                    exc.details() or ""
                ).startswith("shm_name"):
                    raise
                # The file is not visible there after all: bytes from now on.
                self.transports.refused(kv.destination.worker)
        await stub.PushKv(self._chunks(kv), timeout=PUSH_TIMEOUT_S)
        return False

    def _header(self, kv: OutgoingKv) -> worker_pb2.KvTransferHeader:
        identity = self.identity
        return worker_pb2.KvTransferHeader(
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

    def _shm_message(self, kv: OutgoingKv) -> AsyncIterator[worker_pb2.KvChunk]:
        async def generate() -> AsyncIterator[worker_pb2.KvChunk]:
            yield worker_pb2.KvChunk(
                header=self._header(kv),
                block_ids=kv.destination.block_ids,
                shm_name=kv.shm_name,
                shm_num_bytes=int(kv.data.numel()),
            )

        return generate()

    def _chunks(self, kv: OutgoingKv) -> AsyncIterator[worker_pb2.KvChunk]:
        header = self._header(kv)
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
