"""Read a GGUF file's weights (llama.cpp's format) for our parameters: which tensors make each
parameter (`placed_tensors`), and a tensor as float (`float_part`: dequantized with gguf-py,
every type it knows, the same values as `gguf.quants.dequantize`) with llama.cpp's Q/K row
permutation undone where the family's converter applied it. The metadata readers are
torch-free (services/common/gguf_index.py, services/worker/model/families/); the layers that
keep a file's blocks as stored are built in services/worker/quantization/gguf_direct.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from services.common.gguf_index import GGUFIndex, GGUFTensor
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


@dataclass(frozen=True, slots=True)
class PlacedPart:
    """One file tensor as part `part` of a parameter, and the heads whose rows llama.cpp
    permuted in it (0: none)."""

    tensor: GGUFTensor
    part: int
    permuted_heads: int


def placed_tensors(
    index: GGUFIndex, family: ModelFamily, arch: ModelArchitecture
) -> dict[str, list[PlacedPart]]:
    """Our parameter name -> the file tensors that make it, in part order. A parameter with a
    part missing from the file is refused here, naming it."""
    parts: dict[str, dict[int, PlacedPart]] = {}
    counts: dict[str, int] = {}
    for tensor in index.tensors:
        where = gguf_part(family, tensor.name)
        if where is None:
            continue
        counts[where.parameter] = where.num_parts
        heads = qk_heads(family, arch, where.parameter, where.part)
        parts.setdefault(where.parameter, {})[where.part] = PlacedPart(tensor, where.part, heads)
    placed = {}
    for name, found in parts.items():
        missing = [i for i in range(counts[name]) if i not in found]
        if missing:
            raise ModelLoadError(f"incomplete fused weights: {name} lacks parts {missing}")
        placed[name] = [found[i] for i in range(counts[name])]
    return placed


def part_bytes(index: GGUFIndex, placed: PlacedPart, out: np.ndarray | None = None) -> np.ndarray:
    """A part's bytes [rows, bytes per row] as a copy (into `out`, contiguous uint8 of the
    part's size, when given), its rows in our order (llama.cpp's permutation moves whole rows
    of blocks)."""
    if not placed.permuted_heads:
        return index.read(placed.tensor, out)
    rows = unpermute_rows(index.read(placed.tensor), placed.permuted_heads)
    if out is None:
        return np.ascontiguousarray(rows)
    target = out.reshape(rows.shape)
    target[...] = rows
    return target


def float_part(index: GGUFIndex, placed: PlacedPart) -> torch.Tensor:
    """A part as float32 values in our row order (a copy)."""
    values = index.values(placed.tensor)
    if placed.permuted_heads:
        values = unpermute_rows(values, placed.permuted_heads)
    return torch.from_numpy(np.ascontiguousarray(values))


def iter_gguf_weights(
    index: GGUFIndex, placed: dict[str, list[PlacedPart]], names: set[str] | None = None
) -> Iterator[WeightPart]:
    """The parts of every parameter (or of those in `names`) as float32, one tensor at a
    time, addressed to our parameters."""
    for parameter, parts in placed.items():
        if names is not None and parameter not in names:
            continue
        for placed_part in parts:
            yield WeightPart(
                parameter, placed_part.part, len(parts), float_part(index, placed_part)
            )
