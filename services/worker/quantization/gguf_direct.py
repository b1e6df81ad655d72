"""Serve a GGUF file's quantized tensors as the file stores them: every kind the kernels read
(kernels/gguf_blocks_torch.GGUF_KINDS: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL,
IQ4_XS) is kept byte for byte and read by the GGUF kernels (kernels/csrc/gguf_gemm.cpp), so
the weights in memory are the file's and nothing is rounded a second time.

The layers are built straight from the file, on a model constructed on the `meta` device, so
no moment of the load holds a float copy of the model:

    tensors of a layer                       becomes
    parts the kernels read as stored         GGUFLinear over views of the file's mapping (no
      (no row fix, no repacking)               copy: its pages are the page cache's)
    parts that are repacked (the int8        GGUFLinear over one slice per run of parts of
      kernels' 8-row layout) or whose rows     one kind, filled part by part from reads of the
      llama.cpp permuted                       file (never through the mapping); the slices
                                               are back to back on huge pages (huge_pages.py)
    any part of another kind (F16, F32,      a float layer, dequantized tensor by tensor by
      BF16, IQ2/IQ3 ...)                       the float pass of services/worker/loader/

A fused layer (q|k|v, gate|up) keeps its parts side by side (one activation rounding for all
of them): rows are independent, and the q/k row order fix (`unpermute_rows`) moves whole block
rows. A quantized token_embd becomes a GGUFEmbedding (a lookup dequantizes only its rows) and,
in a tied model, the output layer is a GGUFLinear over the same buffer (one copy). Otherwise
the embedding and output layer become int8 per row, as for the other formats.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from kernels import ops
from kernels.gguf_blocks_torch import GGUF_KINDS, REPACKABLE_KINDS
from services.common.gguf_index import GGUFIndex
from services.worker.huge_pages import HugePageArena
from services.worker.loader.gguf_loader import PlacedPart, float_part, part_bytes
from services.worker.model.causal_lm import CausalLM
from services.worker.quantization.gguf_linear import GGUFEmbedding, GGUFLinear

_KIND_BY_ID = {kind: name for name, kind in GGUF_KINDS.items()}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
EMBEDDING = "embed_tokens.weight"
HEAD = "lm_head.weight"


def is_native(parts: list[PlacedPart] | None) -> bool:
    """Whether every part is of a kind the GGUF kernels read."""
    return bool(parts) and all(p.tensor.type_id in _KIND_BY_ID for p in parts or [])


def _mapped(array: np.ndarray) -> Tensor:
    """A tensor over a read-only view of the file's mapping. The kernels only read weights;
    torch warns that writes would be undefined, which no path does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class BlockLayerBuilder:
    """Builds the layers over one file's blocks (`int8_activations`: llama.cpp's arithmetic,
    whose kernels read Q4_0..Q8_0 in their own 8-row layout; otherwise the exact product on the
    file's layout)."""

    def __init__(self, index: GGUFIndex, *, int8_activations: bool) -> None:
        self.index = index
        self.int8_activations = int8_activations
        # What is copied out of the file is at most the file's tensors: a reservation of their
        # size, written only as far as the copies go (services/worker/huge_pages.py).
        self.arena = HugePageArena(max(1, sum(t.num_bytes for t in index.tensors)))

    def _repacked(self, part: PlacedPart) -> bool:
        rows = part.tensor.row_shape[0]
        return self.int8_activations and part.tensor.type_id in REPACKABLE_KINDS and rows % 8 == 0

    def _copied(self, part: PlacedPart) -> bool:
        return bool(part.permuted_heads) or self._repacked(part)

    def blocks(self, parts: list[PlacedPart]) -> tuple[list[Tensor], list[int]]:
        """The block tensors of a layer's parts and their kinds, in output order: a part that
        needs no change is a view of the file; consecutive parts of one kind of which any needs
        a change (a row fix, a repack) share one new buffer."""
        tensors: list[Tensor] = []
        kinds: list[int] = []
        for run in _runs_of_one_kind(parts):
            kind = run[0].tensor.type_id
            if not any(self._copied(part) for part in run):
                for part in run:
                    tensors.append(_mapped(self.index.view(part.tensor)))
                    kinds.append(kind)
                continue
            stacked = self._read_run(run)
            laid_out, laid_kind = (
                ops.gguf_kernel_layout(stacked, kind, in_place=True)
                if self.int8_activations
                else (stacked, kind)
            )
            tensors.append(laid_out)
            kinds.append(laid_kind)
        return tensors, kinds

    def _read_run(self, run: list[PlacedPart]) -> Tensor:
        """The parts' bytes stacked row-wise [rows, bytes per row], read from the file into
        the next slice of the arena."""
        shapes = [part.tensor.row_shape for part in run]
        sizes = [rows * width for rows, width in shapes]
        buffer = self.arena.take(sum(sizes)).numpy()
        at = 0
        for part, size in zip(run, sizes, strict=True):
            part_bytes(self.index, part, buffer[at : at + size])
            at += size
        return torch.from_numpy(buffer).view(sum(rows for rows, _ in shapes), shapes[0][1])

    def linear(self, parts: list[PlacedPart], bias: Tensor | None) -> GGUFLinear:
        tensors, kinds = self.blocks(parts)
        return GGUFLinear(tensors, kinds, bias, int8_activations=self.int8_activations)

    def embedding(self, part: PlacedPart, dtype: torch.dtype) -> GGUFEmbedding:
        (blocks,), (kind,) = self.blocks([part])
        return GGUFEmbedding(blocks, kind, dtype)


def _runs_of_one_kind(parts: list[PlacedPart]) -> list[list[PlacedPart]]:
    runs: list[list[PlacedPart]] = []
    for part in parts:
        if runs and runs[-1][0].tensor.type_id == part.tensor.type_id:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def attach_block_layers(
    model: CausalLM,
    index: GGUFIndex,
    placed: dict[str, list[PlacedPart]],
    *,
    int8_activations: bool,
    dtype: torch.dtype,
    on_tensor: Callable[[int], None] = lambda count: None,
) -> set[str]:
    """Swap `model`'s (meta) projections, embedding and head for layers over the file's
    blocks wherever every part is of a kind the kernels read; returns the parameters now
    served (the float pass loads the rest). `on_tensor(n)`: n more file tensors placed."""
    builder = BlockLayerBuilder(index, int8_activations=int8_activations)
    served: set[str] = set()
    for number, layer in enumerate(model.layers):
        for projection in PROJECTIONS:
            name = f"layers.{number}.{projection}"
            parts = placed.get(f"{name}.weight")
            if not is_native(parts):
                continue
            assert parts is not None
            bias_parts = placed.get(f"{name}.bias")
            bias = None
            if bias_parts is not None:
                bias = torch.cat([float_part(index, part) for part in bias_parts]).to(dtype)
                served.add(f"{name}.bias")
                on_tensor(len(bias_parts))
            owner_name, attribute = projection.split(".")
            setattr(getattr(layer, owner_name), attribute, builder.linear(parts, bias))
            served.add(f"{name}.weight")
            on_tensor(len(parts))

    embedding = placed.get(EMBEDDING)
    if not is_native(embedding):
        return served  # the float pass loads it; the caller rounds it (and the head) to int8
    assert embedding is not None
    table = builder.embedding(embedding[0], dtype)
    model.embed_tokens = table
    served.add(EMBEDDING)
    on_tensor(1)
    if model.architecture.tie_word_embeddings:
        model.lm_head = GGUFLinear(
            table.blocks, table.kind, None, int8_activations=int8_activations
        )
        served.add(HEAD)
    elif is_native(placed.get(HEAD)):
        head = placed[HEAD]
        model.lm_head = builder.linear(head, None)
        served.add(HEAD)
        on_tensor(len(head))
    return served
