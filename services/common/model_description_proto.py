"""ModelDescription ↔ the model.proto message shared by the worker and engine contracts."""

from __future__ import annotations

from protos.llmserve.v1 import model_pb2
from services.contracts.model_description import ModelDescription


def description_to_proto(description: ModelDescription) -> model_pb2.ModelDescription:
    return model_pb2.ModelDescription(
        model_name=description.model_name,
        vocab_size=description.vocab_size,
        max_model_len=description.max_model_len,
        eos_token_ids=list(description.eos_token_ids),
        tokenizer_json=description.tokenizer_json,
        chat_template=description.chat_template,
        bos_token_id=description.bos_token_id,
        add_bos_token=description.add_bos_token,
        tool_use_chat_template=description.tool_use_chat_template,
        special_tokens=dict(description.special_tokens),
    )


def description_from_proto(message: model_pb2.ModelDescription) -> ModelDescription:
    return ModelDescription(
        model_name=message.model_name,
        vocab_size=message.vocab_size,
        max_model_len=message.max_model_len,
        tokenizer_json=message.tokenizer_json,
        chat_template=message.chat_template if message.HasField("chat_template") else None,
        bos_token_id=message.bos_token_id if message.HasField("bos_token_id") else None,
        eos_token_ids=tuple(message.eos_token_ids),
        add_bos_token=message.add_bos_token,
        tool_use_chat_template=(
            message.tool_use_chat_template if message.HasField("tool_use_chat_template") else None
        ),
        special_tokens=tuple(sorted(message.special_tokens.items())),
    )
