from protos.llmserve.v1 import logprobs_pb2 as _logprobs_pb2
from protos.llmserve.v1 import lora_pb2 as _lora_pb2
from protos.llmserve.v1 import model_pb2 as _model_pb2
from protos.llmserve.v1 import sampling_pb2 as _sampling_pb2
from protos.llmserve.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "arrival_unix_s", "cache_salt", "tenant_id", "tenant_weight", "lora_name", "prefill_scheduler", "kv_destination", "prefix_source", "prefix_source_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.TokenSamplingParams
    arrival_unix_s: float
    cache_salt: bytes
    tenant_id: str
    tenant_weight: int
    lora_name: str
    prefill_scheduler: str
    kv_destination: _worker_pb2.KvDestination
    prefix_source: str
    prefix_source_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.TokenSamplingParams, _Mapping]] = ..., arrival_unix_s: _Optional[float] = ..., cache_salt: _Optional[bytes] = ..., tenant_id: _Optional[str] = ..., tenant_weight: _Optional[int] = ..., lora_name: _Optional[str] = ..., prefill_scheduler: _Optional[str] = ..., kv_destination: _Optional[_Union[_worker_pb2.KvDestination, _Mapping]] = ..., prefix_source: _Optional[str] = ..., prefix_source_blocks: _Optional[int] = ...) -> None: ...

class ExportKvRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "kv_destination")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_destination: _worker_pb2.KvDestination
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., kv_destination: _Optional[_Union[_worker_pb2.KvDestination, _Mapping]] = ...) -> None: ...

class ExportKvResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "logprobs", "num_prompt_tokens", "num_cached_tokens", "queue_ms", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_logprobs_pb2.TokenLogprob]
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_ms: float
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_logprobs_pb2.TokenLogprob, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., index: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_free_blocks", "num_total_blocks", "prefix_hit_rate", "num_preemptions", "scheduler_id", "max_waiting_requests", "block_size", "worker_epoch", "max_num_seqs", "num_pinned_blocks", "dtype", "kv_cache_dtype", "quantization", "num_forked_block_refs", "num_block_copies", "num_draft_tokens_proposed", "num_draft_tokens_accepted", "num_speculative_steps", "lora_adapters", "active_lora_adapters", "max_loras", "role")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    NUM_FORKED_BLOCK_REFS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_STEPS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_hit_rate: float
    num_preemptions: int
    scheduler_id: str
    max_waiting_requests: int
    block_size: int
    worker_epoch: str
    max_num_seqs: int
    num_pinned_blocks: int
    dtype: str
    kv_cache_dtype: str
    quantization: str
    num_forked_block_refs: int
    num_block_copies: int
    num_draft_tokens_proposed: int
    num_draft_tokens_accepted: int
    num_speculative_steps: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    active_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    role: str
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., scheduler_id: _Optional[str] = ..., max_waiting_requests: _Optional[int] = ..., block_size: _Optional[int] = ..., worker_epoch: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., num_forked_block_refs: _Optional[int] = ..., num_block_copies: _Optional[int] = ..., num_draft_tokens_proposed: _Optional[int] = ..., num_draft_tokens_accepted: _Optional[int] = ..., num_speculative_steps: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., active_lora_adapters: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("name", "token_ids", "cache_salt", "ttl_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    ttl_s: float
    def __init__(self, name: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("num_pinned_tokens",)
    NUM_PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_pinned_tokens: int
    def __init__(self, num_pinned_tokens: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("unpinned",)
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    unpinned: bool
    def __init__(self, unpinned: _Optional[bool] = ...) -> None: ...

class CancelChoiceRequest(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class CancelChoiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
