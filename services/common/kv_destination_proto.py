"""KvDestination and KvExport ↔ their protos (worker.proto), for the scheduler (Submit, ExportKv,
plans) and the worker."""

from __future__ import annotations

from protos.llmserve.v1 import worker_pb2
from services.contracts.kv_transfer import KvDestination, KvExport


def kv_destination_to_proto(destination: KvDestination | None) -> worker_pb2.KvDestination | None:
    if destination is None:
        return None
    return worker_pb2.KvDestination(
        worker=destination.worker,
        first_block=destination.first_block,
        block_ids=destination.block_ids,
        model_name=destination.model_name,
        kv_cache_dtype=destination.kv_cache_dtype,
        block_size=destination.block_size,
        lora_name=destination.lora_name,
        cache_salt=destination.cache_salt,
        worker_epoch=destination.worker_epoch,
        host_identity=destination.host_identity,
    )


def kv_destination_from_proto(message: worker_pb2.KvDestination) -> KvDestination | None:
    """None for an unset field (no destination: an ordinary sequence)."""
    if not message.worker:
        return None
    return KvDestination(
        worker=message.worker,
        first_block=message.first_block,
        block_ids=list(message.block_ids),
        model_name=message.model_name,
        kv_cache_dtype=message.kv_cache_dtype,
        block_size=message.block_size,
        lora_name=message.lora_name,
        cache_salt=message.cache_salt,
        worker_epoch=message.worker_epoch,
        host_identity=message.host_identity,
    )


def kv_export_to_proto(export: KvExport) -> worker_pb2.KvExport:
    return worker_pb2.KvExport(
        request_id=export.request_id,
        block_ids=export.block_ids,
        kv_destination=kv_destination_to_proto(export.destination),
        block_hashes=export.block_hashes,
    )


def kv_export_from_proto(message: worker_pb2.KvExport) -> KvExport:
    destination = kv_destination_from_proto(message.kv_destination)
    if destination is None:
        raise ValueError(f"kv export {message.request_id!r} has no kv_destination")
    return KvExport(
        message.request_id, list(message.block_ids), destination, list(message.block_hashes)
    )
