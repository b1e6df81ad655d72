"""Build a model from a GGUF file or a Hugging Face directory, showing progress.

The decoder is constructed on the `meta` device (no memory), then every parameter gets its
final storage once: a GGUF file served from its blocks (`--quantization gguf`, `gguf-exact`)
swaps in layers over the file's bytes (services/worker/quantization/gguf_direct.py), and each
remaining parameter (norms, biases, float layers) is allocated in the model dtype and filled
tensor by tensor. The peak of a load is the final model plus one tensor in float32, never a
float copy of the whole model."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from services.common.gguf_index import open_gguf_index
from services.contracts.errors import ModelLoadError
from services.worker.loader.gguf_loader import iter_gguf_weights, placed_tensors
from services.worker.loader.hf_loader import hf_tensor_count, iter_hf_weights
from services.worker.model.causal_lm import CausalLM, WeightPart
from services.worker.model.families import gguf_model_architecture, hf_model_architecture
from services.worker.quantization.formats import InvalidFormatError, resolve_quantization
from services.worker.quantization.linear import Int8WeightOnlyLinear

log = logging.getLogger(__name__)

GGUF_BLOCK_FORMATS = ("gguf", "gguf-exact")


def load_model(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    show_progress: bool | None = None,
    quantization: str = "none",
) -> CausalLM:
    """Load the model at `path` in `dtype` on `device` (eval, no grad), its weights in the
    `quantization` format (`auto` resolved here: a GGUF file keeps its blocks).

    show_progress None means: a bar on stderr when it is a terminal.
    """
    started = time.perf_counter()
    quantization = resolve_quantization(quantization, path)
    if quantization in GGUF_BLOCK_FORMATS and path.suffix != ".gguf":
        raise InvalidFormatError(f"--quantization {quantization} needs a .gguf model, got {path}")
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    if path.suffix == ".gguf":
        index = open_gguf_index(path)
        family, arch = gguf_model_architecture(index)
        total = len(index.tensors)
    else:
        family, arch = hf_model_architecture(path)
        total = hf_tensor_count(path)
    bar = tqdm(
        total=total,
        desc=f"loading {path.name}",
        unit="tensor",
        disable=not show_progress,
        file=sys.stderr,
    )
    with torch.device("meta"):
        model = CausalLM(arch, max_positions=max_positions)
    if path.suffix == ".gguf":
        placed = placed_tensors(index, family, arch)
        served: set[str] = set()
        if quantization in GGUF_BLOCK_FORMATS:
            from services.worker.quantization.gguf_direct import attach_block_layers

            served = attach_block_layers(
                model,
                index,
                placed,
                int8_activations=quantization == "gguf",
                dtype=dtype,
                on_tensor=bar.update,
            )
        _materialize(model, dtype, device)
        rest = set(placed) - served
        weights: Iterable[WeightPart] = iter_gguf_weights(index, placed, rest)
    else:
        _materialize(model, dtype, device)
        weights = iter_hf_weights(path, family)
    model.load_weights(_counted(weights, bar))
    bar.close()
    model.rope = model.rope.to(device)
    model.local_rope = None if model.local_rope is None else model.local_rope.to(device)
    _finish_format(model, quantization)
    _check_materialized(model)
    model.eval()
    log.info(
        "model loaded",
        extra={
            "path": str(path),
            "family": family.name,
            "dtype": str(dtype),
            "quantization": quantization,
            "seconds": round(time.perf_counter() - started, 3),
        },
    )
    return model


def _materialize(model: CausalLM, dtype: torch.dtype, device: torch.device | str) -> None:
    """Give every parameter still on `meta` empty storage in `dtype` on `device` (a
    parameter shared by two modules, the tied embedding and head, stays shared)."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in done:
                storage = torch.empty(param.shape, dtype=dtype, device=device)
                done[id(param)] = nn.Parameter(storage, requires_grad=False)
            module._parameters[name] = done[id(param)]


def _finish_format(model: CausalLM, quantization: str) -> None:
    """What the float pass leaves to the weight format: under GGUF blocks, an embedding or
    head the kernels cannot read becomes int8 rows; the formats made from float weights swap
    every layer (services/worker/quantization/swap.py)."""
    from services.worker.quantization.swap import quantize_model, quantize_output_and_embedding

    if quantization in GGUF_BLOCK_FORMATS:
        if isinstance(model.embed_tokens, nn.Embedding):
            quantize_output_and_embedding(model, Int8WeightOnlyLinear.from_float)
        elif isinstance(model.lm_head, nn.Linear):
            model.lm_head = Int8WeightOnlyLinear.from_float(model.lm_head.weight.data, None)
    elif quantization != "none":
        quantize_model(model, quantization)


def _check_materialized(model: CausalLM) -> None:
    meta = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if meta:
        raise ModelLoadError(f"weights missing from the checkpoint: {sorted(meta)[:8]}")


def _counted(weights: Iterable[WeightPart], bar: tqdm) -> Iterator[WeightPart]:
    for item in weights:
        yield item
        bar.update(1)
