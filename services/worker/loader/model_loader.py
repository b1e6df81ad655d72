"""Build a model from a GGUF file or a Hugging Face directory, showing progress."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from services.common.gguf_metadata import open_gguf
from services.worker.loader.gguf_loader import iter_gguf_weights
from services.worker.loader.hf_loader import hf_tensor_count, iter_hf_weights
from services.worker.model.causal_lm import CausalLM, WeightPart
from services.worker.model.families import gguf_model_architecture, hf_model_architecture

log = logging.getLogger(__name__)


def load_model(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    show_progress: bool | None = None,
) -> CausalLM:
    """Load weights into the decoder in `dtype` on `device` (eval, no grad).

    show_progress None means: a bar on stderr when it is a terminal.
    """
    started = time.perf_counter()
    if path.suffix == ".gguf":
        reader = open_gguf(path)
        family, arch = gguf_model_architecture(reader)
        weights: Iterable[WeightPart] = iter_gguf_weights(reader, family, arch)
        total = len(reader.tensors)
    else:
        family, arch = hf_model_architecture(path)
        weights = iter_hf_weights(path, family)
        total = hf_tensor_count(path)
    # Build on the meta device so no time goes to random init of weights we overwrite.
    with torch.device("meta"):
        model = CausalLM(arch, max_positions=max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.rope = model.rope_table(local=False).to(device)
    local_rope = model.rope_table(local=True)
    model.local_rope = None if local_rope is None else local_rope.to(device)
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    bar = tqdm(
        total=total,
        desc=f"loading {path.name}",
        unit="tensor",
        disable=not show_progress,
        file=sys.stderr,
    )
    model.load_weights(_counted(weights, bar))
    bar.close()
    model.eval()
    log.info(
        "model loaded",
        extra={
            "path": str(path),
            "family": family.name,
            "dtype": str(dtype),
            "seconds": time.perf_counter() - started,
        },
    )
    return model


def _counted(weights: Iterable[WeightPart], bar: tqdm) -> Iterator[WeightPart]:
    for item in weights:
        yield item
        bar.update(1)
