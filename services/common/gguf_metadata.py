"""GGUF metadata (llama.cpp's format), torch-free: the model config reader and the worker's
weight loader read the same parsed file; the tokenizer reads only the key-value header."""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.contracts.errors import ModelLoadError


@functools.lru_cache(maxsize=4)
def open_gguf(path: Path) -> Any:
    """One parsed reader per file and process: parsing the metadata (49k token strings for
    SmolLM2) takes seconds, and the config readers and the weight loader all need it."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises bare ValueErrors on bad magic/versions
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


# GGUF value types (gguf.GGUFValueType) -> struct formats; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?"}
_SCALAR_FORMATS |= {10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@functools.lru_cache(maxsize=4)
def read_metadata(path: Path) -> Mapping[str, Any]:
    """The key-value header of a GGUF file (v2 or v3), values as `field_value` gives them,
    without the tensor index: a 128k-token vocabulary reads in a fraction of a second where
    `gguf.GGUFReader` (a numpy view per string) takes tens of seconds."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return read_header(data, path).metadata
    except (OSError, ValueError, struct.error) as exc:  # truncated, or not UTF-8
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    metadata: Mapping[str, Any]
    num_tensors: int
    end: int
    """Offset of the first byte after the key-value pairs: the tensor index starts there."""


def read_header(data: mmap.mmap, path: Path) -> GGUFHeader:
    """Magic, version and key-value pairs of a mapped GGUF file."""
    if data[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file")
    (version,) = struct.unpack_from("<I", data, 4)
    if version not in (2, 3):
        raise ModelLoadError(f"GGUF version {version} of {path} is not supported")
    num_tensors, num_values = struct.unpack_from("<QQ", data, 8)
    metadata: dict[str, Any] = {}
    offset = 24
    for _ in range(num_values):
        key, offset = read_string(data, offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        metadata[key], offset = _read_value(data, offset + 4, kind)
    return GGUFHeader(metadata, num_tensors, offset)


def read_string(data: mmap.mmap, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    start = offset + 8
    return data[start : start + length].decode("utf-8"), start + length


def _read_value(data: mmap.mmap, offset: int, kind: int) -> tuple[Any, int]:
    if kind == _STRING:
        return read_string(data, offset)
    if kind == _ARRAY:
        item_kind, count = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if item_kind in _SCALAR_FORMATS:
            layout = struct.Struct(f"<{count}{_SCALAR_FORMATS[item_kind]}")
            return list(layout.unpack_from(data, offset)), offset + layout.size
        items = []
        for _ in range(count):
            item, offset = _read_value(data, offset, item_kind)
            items.append(item)
        return items, offset
    if kind not in _SCALAR_FORMATS:
        raise ValueError(f"unknown GGUF value type {kind}")
    layout = struct.Struct(f"<{_SCALAR_FORMATS[kind]}")
    return layout.unpack_from(data, offset)[0], offset + layout.size
