from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelDescription(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_model_len", "eos_token_ids", "tokenizer_json", "chat_template", "bos_token_id", "add_bos_token", "tool_use_chat_template", "special_tokens")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOOL_USE_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_json: str
    chat_template: str
    bos_token_id: int
    add_bos_token: bool
    tool_use_chat_template: str
    special_tokens: _containers.ScalarMap[str, str]
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., bos_token_id: _Optional[int] = ..., add_bos_token: _Optional[bool] = ..., tool_use_chat_template: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ...) -> None: ...
