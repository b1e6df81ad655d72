from protos.llmserve.v1 import logprobs_pb2 as _logprobs_pb2
from protos.llmserve.v1 import lora_pb2 as _lora_pb2
from protos.llmserve.v1 import model_pb2 as _model_pb2
from protos.llmserve.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrepareGrammarRequest(_message.Message):
    __slots__ = ("structured_output",)
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    structured_output: _sampling_pb2.StructuredOutput
    def __init__(self, structured_output: _Optional[_Union[_sampling_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class PrepareGrammarResponse(_message.Message):
    __slots__ = ("compile_ms",)
    COMPILE_MS_FIELD_NUMBER: _ClassVar[int]
    compile_ms: float
    def __init__(self, compile_ms: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerDescription(_message.Message):
    __slots__ = ("architecture", "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_dtype", "quantization", "worker_epoch", "model", "sliding_window", "max_loras", "max_lora_rank", "memory", "batch_invariant", "kv_disk_block_hashes", "kv_disk_tier", "host_identity")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_TIER_FIELD_NUMBER: _ClassVar[int]
    HOST_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    dtype: str
    device: str
    block_size: int
    num_kv_blocks: int
    kv_cache_dtype: str
    quantization: str
    worker_epoch: str
    model: _model_pb2.ModelDescription
    sliding_window: int
    max_loras: int
    max_lora_rank: int
    memory: MemoryBudget
    batch_invariant: bool
    kv_disk_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    kv_disk_tier: bool
    host_identity: str
    def __init__(self, architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., worker_epoch: _Optional[str] = ..., model: _Optional[_Union[_model_pb2.ModelDescription, _Mapping]] = ..., sliding_window: _Optional[int] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., memory: _Optional[_Union[MemoryBudget, _Mapping]] = ..., batch_invariant: _Optional[bool] = ..., kv_disk_block_hashes: _Optional[_Iterable[bytes]] = ..., kv_disk_tier: _Optional[bool] = ..., host_identity: _Optional[str] = ...) -> None: ...

class MemoryBudget(_message.Message):
    __slots__ = ("weight_bytes_by_kind", "weight_mapped_bytes", "kv_cache_bytes", "kv_cache_blocks", "kv_cache_tokens", "runtime_bytes", "machine_bytes")
    class WeightBytesByKindEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WEIGHT_BYTES_BY_KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_BYTES_FIELD_NUMBER: _ClassVar[int]
    MACHINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    weight_bytes_by_kind: _containers.ScalarMap[str, int]
    weight_mapped_bytes: int
    kv_cache_bytes: int
    kv_cache_blocks: int
    kv_cache_tokens: int
    runtime_bytes: int
    machine_bytes: int
    def __init__(self, weight_bytes_by_kind: _Optional[_Mapping[str, int]] = ..., weight_mapped_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_cache_blocks: _Optional[int] = ..., kv_cache_tokens: _Optional[int] = ..., runtime_bytes: _Optional[int] = ..., machine_bytes: _Optional[int] = ...) -> None: ...

class AwaitKvRequest(_message.Message):
    __slots__ = ("request_id", "worker_epoch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_epoch: str
    def __init__(self, request_id: _Optional[str] = ..., worker_epoch: _Optional[str] = ...) -> None: ...

class KvTransferHeader(_message.Message):
    __slots__ = ("request_id", "model_name", "kv_cache_dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "lora_name", "cache_salt", "num_blocks", "worker_epoch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_name: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    lora_name: str
    cache_salt: bytes
    num_blocks: int
    worker_epoch: str
    def __init__(self, request_id: _Optional[str] = ..., model_name: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[bytes] = ..., num_blocks: _Optional[int] = ..., worker_epoch: _Optional[str] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("header", "block_ids", "data", "shm_name", "shm_num_bytes")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    header: KvTransferHeader
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shm_name: str
    shm_num_bytes: int
    def __init__(self, header: _Optional[_Union[KvTransferHeader, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shm_name: _Optional[str] = ..., shm_num_bytes: _Optional[int] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("num_blocks_written",)
    NUM_BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    num_blocks_written: int
    def __init__(self, num_blocks_written: _Optional[int] = ...) -> None: ...

class KvDestination(_message.Message):
    __slots__ = ("worker", "first_block", "block_ids", "model_name", "kv_cache_dtype", "block_size", "lora_name", "cache_salt", "worker_epoch", "host_identity")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOST_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    worker: str
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    model_name: str
    kv_cache_dtype: str
    block_size: int
    lora_name: str
    cache_salt: bytes
    worker_epoch: str
    host_identity: str
    def __init__(self, worker: _Optional[str] = ..., first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., model_name: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[bytes] = ..., worker_epoch: _Optional[str] = ..., host_identity: _Optional[str] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "block_ids", "num_computed_tokens", "sampling", "lora_name", "cache_salt", "kv_destination")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    sampling: _sampling_pb2.TokenSamplingParams
    lora_name: str
    cache_salt: bytes
    kv_destination: KvDestination
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_sampling_pb2.TokenSamplingParams, _Mapping]] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[bytes] = ..., kv_destination: _Optional[_Union[KvDestination, _Mapping]] = ...) -> None: ...

class SequenceDelta(_message.Message):
    __slots__ = ("request_id", "new_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class DiskStore(_message.Message):
    __slots__ = ("block_id", "block_hash", "lora_name", "cache_salt")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    block_hash: bytes
    lora_name: str
    cache_salt: bytes
    def __init__(self, block_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class DiskBlock(_message.Message):
    __slots__ = ("block_id", "block_hash")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    block_hash: bytes
    def __init__(self, block_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class DiskLoads(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[DiskBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[DiskBlock, _Mapping]]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "finished_request_ids", "new_sequences", "block_deltas", "scheduled_request_ids", "num_scheduled_tokens", "block_copies", "draft_slots", "block_truncations", "disk_stores", "disk_loads", "kv_exports")
    class DraftSlotsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class BlockTruncationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DiskLoadsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: DiskLoads
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[DiskLoads, _Mapping]] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DELTAS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TRUNCATIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_STORES_FIELD_NUMBER: _ClassVar[int]
    DISK_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    block_deltas: _containers.RepeatedCompositeFieldContainer[SequenceDelta]
    scheduled_request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    block_copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    draft_slots: _containers.ScalarMap[str, int]
    block_truncations: _containers.ScalarMap[str, int]
    disk_stores: _containers.RepeatedCompositeFieldContainer[DiskStore]
    disk_loads: _containers.MessageMap[str, DiskLoads]
    kv_exports: _containers.RepeatedCompositeFieldContainer[KvExport]
    def __init__(self, step_id: _Optional[int] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., block_deltas: _Optional[_Iterable[_Union[SequenceDelta, _Mapping]]] = ..., scheduled_request_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., block_copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., draft_slots: _Optional[_Mapping[str, int]] = ..., block_truncations: _Optional[_Mapping[str, int]] = ..., disk_stores: _Optional[_Iterable[_Union[DiskStore, _Mapping]]] = ..., disk_loads: _Optional[_Mapping[str, DiskLoads]] = ..., kv_exports: _Optional[_Iterable[_Union[KvExport, _Mapping]]] = ...) -> None: ...

class KvExport(_message.Message):
    __slots__ = ("request_id", "block_ids", "kv_destination", "block_hashes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_destination: KvDestination
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., kv_destination: _Optional[_Union[KvDestination, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("step_id", "sampled_request_ids", "sampled_token_ids", "logprobs", "forward_ms", "drafts", "failed_sequences", "disk_added", "disk_evicted")
    class LogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _logprobs_pb2.TokenLogprob
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_logprobs_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...
    class DraftsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: DraftOutcome
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[DraftOutcome, _Mapping]] = ...) -> None: ...
    class FailedSequencesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    DISK_ADDED_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_request_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.MessageMap[str, _logprobs_pb2.TokenLogprob]
    forward_ms: float
    drafts: _containers.MessageMap[str, DraftOutcome]
    failed_sequences: _containers.ScalarMap[str, str]
    disk_added: _containers.RepeatedScalarFieldContainer[bytes]
    disk_evicted: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, step_id: _Optional[int] = ..., sampled_request_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Mapping[str, _logprobs_pb2.TokenLogprob]] = ..., forward_ms: _Optional[float] = ..., drafts: _Optional[_Mapping[str, DraftOutcome]] = ..., failed_sequences: _Optional[_Mapping[str, str]] = ..., disk_added: _Optional[_Iterable[bytes]] = ..., disk_evicted: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DraftOutcome(_message.Message):
    __slots__ = ("num_proposed", "accepted_token_ids", "proposer")
    NUM_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    num_proposed: int
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    proposer: str
    def __init__(self, num_proposed: _Optional[int] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ..., proposer: _Optional[str] = ...) -> None: ...
