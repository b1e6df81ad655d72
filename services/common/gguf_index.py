"""A GGUF file's tensors as the file lays them out, read without gguf-py's reader: names,
ggml types, shapes and offsets from the index, and each tensor's bytes either as a read-only
view of one memory mapping of the file (a weight served as stored costs no copy, and its pages
are shared with the page cache) or copied out with a plain read (a tensor that is repacked or
dequantized: its pages never become part of the process's mapped memory).

    GGUF file:  header | key-values | tensor index | padding | data (aligned) ...
                                      name, dims (fastest first), type, offset from data start
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.common.gguf_metadata import read_header, read_string
from services.contracts.errors import ModelLoadError

DEFAULT_ALIGNMENT = 32
# ggml type ids stored as plain numbers (everything else is blocks of values).
FLOAT_TYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float16)}
BF16_TYPE = 30


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the index."""

    name: str
    shape: tuple[int, ...]
    """Slowest dim first (numpy's order; GGUF stores them fastest first)."""
    type_id: int
    """ggml type (gguf.GGMLQuantizationType's value)."""
    offset: int
    """Absolute offset of its first byte in the file."""
    num_bytes: int

    @property
    def num_values(self) -> int:
        return math.prod(self.shape)

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"

    @property
    def row_shape(self) -> tuple[int, int]:
        """(rows, bytes per row): the shape of its bytes, one row of blocks per output."""
        rows = math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1
        return rows, self.num_bytes // rows


def _tensor_bytes(name: str, dims: tuple[int, ...], type_id: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"GGUF tensor {name!r} has unknown type {type_id}") from exc
    values = math.prod(dims)
    if dims and dims[0] % block_values:
        raise ModelLoadError(
            f"GGUF tensor {name!r}: {dims[0]} values per row is not a multiple of its"
            f" type's {block_values}-value blocks"
        )
    return values // block_values * block_bytes


class GGUFIndex:
    """The key-values and tensors of one GGUF file, and access to the tensors' bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - kept open for reads while loading
            self._mapping = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            header = read_header(self._mapping, path)
            self.metadata: Mapping[str, Any] = header.metadata
            self.tensors = self._read_index(header.num_tensors, header.end)
        except (OSError, ValueError, struct.error) as exc:
            raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
        self.by_name = {tensor.name: tensor for tensor in self.tensors}

    def _read_index(self, count: int, offset: int) -> list[GGUFTensor]:
        data = self._mapping
        entries = []
        for _ in range(count):
            name, offset = read_string(data, offset)
            (num_dims,) = struct.unpack_from("<I", data, offset)
            dims = struct.unpack_from(f"<{num_dims}Q", data, offset + 4)
            type_id, relative = struct.unpack_from("<IQ", data, offset + 4 + 8 * num_dims)
            offset += 4 + 8 * num_dims + 12
            entries.append((name, tuple(int(d) for d in dims), int(type_id), int(relative)))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-offset // alignment) * alignment
        size = len(data)
        tensors = []
        for name, dims, type_id, relative in entries:
            tensor = GGUFTensor(
                name,
                tuple(reversed(dims)),
                type_id,
                data_start + relative,
                _tensor_bytes(name, dims, type_id),
            )
            if tensor.offset + tensor.num_bytes > size:
                raise ModelLoadError(
                    f"GGUF tensor {name!r} ends past the end of {self.path} (a truncated file?)"
                )
            tensors.append(tensor)
        return tensors

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def view(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes [rows, bytes per row], read-only, in the file's mapping: no copy,
        and its pages are resident only once read."""
        flat = np.frombuffer(self._mapping, np.uint8, tensor.num_bytes, tensor.offset)
        return flat.reshape(tensor.row_shape)

    def read(self, tensor: GGUFTensor, out: np.ndarray | None = None) -> np.ndarray:
        """A writable copy of the tensor's bytes [rows, bytes per row], read from the file
        (not through the mapping, so the process does not keep the pages it copied); into
        `out` (contiguous uint8 of the tensor's size) when given."""
        if out is None:
            out = np.empty(tensor.num_bytes, np.uint8)
        elif out.dtype != np.uint8 or out.size != tensor.num_bytes or not out.flags.c_contiguous:
            raise ValueError(f"GGUF tensor {tensor.name!r}: `out` is not {tensor.num_bytes} bytes")
        view = memoryview(out.reshape(-1))
        done = 0
        while done < tensor.num_bytes:
            got = os.preadv(self._file.fileno(), [view[done:]], tensor.offset + done)
            if got <= 0:
                raise ModelLoadError(f"GGUF tensor {tensor.name!r}: short read from {self.path}")
            done += got
        return out.reshape(tensor.row_shape)

    def values(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor as float32 values in its shape (a copy): plain floats converted, blocks
        dequantized by gguf-py (`gguf.quants.dequantize`, the reference of every kernel)."""
        raw = self.read(tensor)
        if tensor.type_id in FLOAT_TYPES:
            array = raw.reshape(-1).view(FLOAT_TYPES[tensor.type_id]).astype(np.float32)
        elif tensor.type_id == BF16_TYPE:
            array = (raw.reshape(-1).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            try:
                array = dequantize(raw, GGMLQuantizationType(tensor.type_id))
            except NotImplementedError as exc:
                raise ModelLoadError(
                    f"GGUF tensor {tensor.name!r} has type {tensor.type_name},"
                    " which gguf-py cannot dequantize"
                ) from exc
        return array.astype(np.float32, copy=False).reshape(tensor.shape)


@functools.lru_cache(maxsize=4)
def open_gguf_index(path: Path) -> GGUFIndex:
    """One index per file and process (the config readers and the weight loader share it)."""
    return GGUFIndex(path)
