from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "targets", "scaling", "load_ms", "slot", "num_running", "parent", "num_loaded_schedulers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    targets: _containers.RepeatedScalarFieldContainer[str]
    scaling: float
    load_ms: float
    slot: int
    num_running: int
    parent: str
    num_loaded_schedulers: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., targets: _Optional[_Iterable[str]] = ..., scaling: _Optional[float] = ..., load_ms: _Optional[float] = ..., slot: _Optional[int] = ..., num_running: _Optional[int] = ..., parent: _Optional[str] = ..., num_loaded_schedulers: _Optional[int] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("num_unloaded_schedulers",)
    NUM_UNLOADED_SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    num_unloaded_schedulers: int
    def __init__(self, num_unloaded_schedulers: _Optional[int] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...
