"""A GGUF file's header (metadata and tensor infos) read in one pass with struct.

gguf.GGUFReader makes a numpy view per array item: on a file with a 128k-token vocabulary it
takes 10 to 30 s, this about a second. The tests check one file per family with GGUFReader too.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

# GGUF value types: their struct codes (8 string and 9 array are read apart).
SCALAR_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
STRING_TYPE = 8
ARRAY_TYPE = 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    type_name: str  # GGML type: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # GGUF order: the row length first


@dataclass(frozen=True, slots=True)
class GgufHeader:
    # Scalars and strings; arrays only when asked for by key (else their length).
    metadata: dict[str, object]
    tensors: dict[str, TensorInfo]


def read_gguf_header(path: Path, array_keys: tuple[str, ...] = ()) -> GgufHeader:
    """The header; only the pages it spans are read (memory-mapped)."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return parse_header(path, data, array_keys)


def parse_header(path: Path, data: mmap.mmap, array_keys: tuple[str, ...]) -> GgufHeader:
    import gguf

    magic, _version, num_tensors, num_kv = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    offset = 24

    def read_string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        return data[at + 8 : at + 8 + length].decode("utf-8"), at + 8 + length

    def read_value(kind: int, at: int, keep: bool) -> tuple[object, int]:
        if kind == STRING_TYPE:
            return read_string(at)
        if kind != ARRAY_TYPE:
            code = SCALAR_FORMATS[kind]
            return struct.unpack_from("<" + code, data, at)[0], at + struct.calcsize(code)
        item_kind, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if item_kind in SCALAR_FORMATS:
            code = SCALAR_FORMATS[item_kind]
            end = at + count * struct.calcsize(code)
            items = list(struct.unpack_from(f"<{count}{code}", data, at)) if keep else count
            return items, end
        values = []
        for _ in range(count):
            value, at = read_value(item_kind, at, keep)
            values.append(value)
        return (values if keep else count), at

    metadata: dict[str, object] = {}
    for _ in range(num_kv):
        key, offset = read_string(offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        value, offset = read_value(kind, offset + 4, keep=key in array_keys)
        metadata[key] = value
    tensors = {}
    for _ in range(num_tensors):
        name, offset = read_string(offset)
        (num_dims,) = struct.unpack_from("<I", data, offset)
        shape = struct.unpack_from(f"<{num_dims}Q", data, offset + 4)
        offset += 4 + 8 * num_dims
        type_id, _data_offset = struct.unpack_from("<IQ", data, offset)
        offset += 12
        type_name = gguf.GGMLQuantizationType(type_id).name
        tensors[name] = TensorInfo(type_name, tuple(int(n) for n in shape))
    return GgufHeader(metadata, tensors)
