"""KV transfer between workers (services/worker/kv_transfer*.py): which blocks a prefill worker
copies out and when, the identity checks, and a push over a real loopback gRPC server into
another cache, byte for byte."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import torch

from protos.llmserve.v1 import worker_pb2_grpc
from services.contracts.kv_transfer import KvDestination
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence, StepResult
from services.worker import kv_transfer_service
from services.worker.input_batch import CachedSequence
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.kv_transfer import CacheIdentity, KvInbox, KvOutbox
from services.worker.kv_transfer_service import KvSender, KvTransferServicer

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


def test_identity_names_the_first_field_that_differs() -> None:
    cache = filled_cache()
    other = CacheIdentity("m", "float16", BLOCK_SIZE, 2, 2, 8)
    message = identity(cache).mismatch(other)
    assert message is not None and message.startswith("kv_cache_dtype differs")
    assert identity(cache).mismatch(identity(filled_cache(seed=1))) is None


async def _push(
    sender_cache: PagedKVCache,
    receiver_cache: PagedKVCache,
    dest_blocks: list[int],
    receiver_model: str = "m",
    receiver_epoch: str = EPOCH,
    given_up: tuple[str, ...] = (),
) -> StepResult:
    """Push request "r"'s prompt from one cache into another through a real gRPC server; the
    receiver's scheduler has given up the transfers of `given_up` first."""
    inbox = KvInbox(identity(receiver_cache, receiver_model), receiver_epoch)
    inbox.on_plan(BatchPlan(step_id=0, finished_request_ids=list(given_up)), {})
    server = grpc.aio.server()

    async def on_forward_thread(function: Any, *args: Any) -> Any:
        return await asyncio.to_thread(function, *args)

    servicer = KvTransferServicer(lambda: (receiver_cache, inbox), on_forward_thread)
    worker_pb2_grpc.add_KvTransferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        outbox = KvOutbox(identity(sender_cache))
        dest = destination(0, dest_blocks, worker=f"127.0.0.1:{port}")
        plan, result, sequences = prefill_step(dest, sampled=True)
        outgoing = outbox.collect(plan, result, sequences, sender_cache)
        await KvSender(identity(sender_cache), None).send_all(result, outgoing)
        return result
    finally:
        await server.stop(0)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, SPEC.bytes_per_block])
def test_a_push_writes_the_blocks_into_the_reserved_ones_byte_for_byte(
    chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One message for all three blocks, or one per block.
    monkeypatch.setattr(kv_transfer_service, "CHUNK_BYTES", chunk_bytes)
    sender, receiver = filled_cache(seed=1), PagedKVCache(SPEC, 12, "cpu")
    result = asyncio.run(_push(sender, receiver, [11, 0, 6]))
    assert result.sampled_token_ids == {"r": 42} and not result.failed_sequences
    for source, target in zip([3, 7, 5], [11, 0, 6], strict=True):
        assert torch.equal(receiver.storage[:, :, target], sender.storage[:, :, source])
    untouched = [b for b in range(12) if b not in (11, 0, 6)]
    assert receiver.storage[:, :, untouched].abs().sum() == 0


@pytest.mark.parametrize(
    ("dest_blocks", "receiver_model", "receiver_epoch", "given_up", "reason"),
    [
        ([1, 2, 99], "m", EPOCH, (), "block_ids: 99"),
        ([1, 2, 3], "other", EPOCH, (), "model_name differs"),
        ([1, 2, 3], "m", "epoch-2", (), "restarted"),
        ([1, 2, 3], "m", EPOCH, ("r",), "gave up"),
    ],
)
def test_a_refused_push_writes_nothing_and_fails_the_sequence_with_the_receivers_reason(
    dest_blocks: list[int],
    receiver_model: str,
    receiver_epoch: str,
    given_up: tuple[str, ...],
    reason: str,
) -> None:
    sender, receiver = filled_cache(seed=1), PagedKVCache(SPEC, 12, "cpu")
    result = asyncio.run(
        _push(sender, receiver, dest_blocks, receiver_model, receiver_epoch, given_up)
    )
    assert "r" not in result.sampled_token_ids
    assert reason in result.failed_sequences["r"]
    assert receiver.storage.abs().sum() == 0


def test_only_sequences_never_held_count_as_given_up_transfers() -> None:
    cache = filled_cache()
    inbox = KvInbox(identity(cache), EPOCH)
    held = {"done": CachedSequence("done", [1], 1, [0], 1, SamplingParams())}
    inbox.on_plan(BatchPlan(step_id=0, finished_request_ids=["done", "gone"]), held)
    data = cache.read_blocks([1])
    assert inbox.write("done", [2], data, cache)
    assert not inbox.write("gone", [3], data, cache)
