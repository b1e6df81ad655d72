"""Read a GGUF file's weights (llama.cpp's format; the metadata readers are torch-free, in
services/common/gguf_metadata.py and services/worker/model/families/), dequantized to float
with gguf-py (every tensor type it knows: the same values as `gguf.quants.dequantize`) and
addressed to our parameters, with llama.cpp's Q/K row permutation undone where the family's
converter applied it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from services.contracts.errors import ModelLoadError
from services.worker.loader.weight_names import gguf_part
from services.worker.model.architecture import ModelArchitecture
from services.worker.model.causal_lm import WeightPart
from services.worker.model.families.base import ModelFamily

_QKV = "self_attn.qkv_proj"


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves.

    llama.cpp stores each head's rows as (pairs of) interleaved halves [x0, x_{d/2}, x1, ...];
    Hugging Face's rotate_half wants [x0, x1, ..., | x_{d/2}, ...]. Rows are grouped per head:
    (heads, d/2, 2, ...) → swap → (heads, 2, d/2, ...).
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def qk_heads(family: ModelFamily, arch: ModelArchitecture, parameter: str, part: int) -> int:
    """The heads whose rows llama.cpp permuted in this tensor (0: not permuted)."""
    if not family.gguf_permuted_qk or not parameter.endswith((f"{_QKV}.weight", f"{_QKV}.bias")):
        return 0
    return {0: arch.num_heads, 1: arch.num_kv_heads}.get(part, 0)


def dequantized(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32, slowest dim first."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type == GGMLQuantizationType.F32:
        array = np.array(tensor.data, dtype=np.float32)  # copy: the file is mapped read-only
    else:
        try:
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name},"
                " which gguf-py cannot dequantize"
            ) from exc
    # GGUF lists dims fastest-first; numpy wants them slowest-first.
    return array.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def iter_gguf_weights(
    reader: Any, family: ModelFamily, arch: ModelArchitecture
) -> Iterator[WeightPart]:
    """Every weight tensor of the file, as float32, addressed to our parameters."""
    for tensor in reader.tensors:
        where = gguf_part(family, tensor.name)
        if where is None:
            continue
        array = dequantized(tensor)
        heads = qk_heads(family, arch, where.parameter, where.part)
        if heads:
            array = unpermute_rows(array, heads)
        yield WeightPart(*where, torch.from_numpy(np.ascontiguousarray(array)))
