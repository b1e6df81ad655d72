"""LoraAdapterInfo (services/contracts/lora.py) to and from its lora.proto message: the worker
answers with it, the scheduler reads it and answers its own callers with it."""

from __future__ import annotations

from protos.llmserve.v1 import lora_pb2
from services.contracts.lora import LoraAdapterInfo


def lora_adapter_info_to_proto(info: LoraAdapterInfo) -> lora_pb2.LoraAdapterInfo:
    return lora_pb2.LoraAdapterInfo(
        name=info.name,
        path=info.path,
        rank=info.rank,
        targets=list(info.targets),
        scaling=info.scaling,
        load_ms=info.load_ms,
        slot=info.slot,
        num_running=info.num_running,
    )


def lora_adapter_info_from_proto(message: lora_pb2.LoraAdapterInfo) -> LoraAdapterInfo:
    return LoraAdapterInfo(
        name=message.name,
        path=message.path,
        rank=message.rank,
        targets=tuple(message.targets),
        scaling=message.scaling,
        load_ms=message.load_ms,
        slot=message.slot,
        num_running=message.num_running,
    )
