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
from services.contracts.model_config import gguf_model_config, hf_model_config
from services.worker.loader.gguf_loader import iter_gguf_weights
from services.worker.loader.hf_loader import hf_tensor_count, iter_hf_weights
from services.worker.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def load_model(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    show_progress: bool | None = None,
) -> LlamaForCausalLM:
    """Load weights into a LlamaForCausalLM in `dtype` on `device` (eval, no grad).

    show_progress None means: a bar on stderr when it is a terminal.
    """
    started = time.perf_counter()
    if path.suffix == ".gguf":
        reader = open_gguf(path)
        config = gguf_model_config(reader)
        weights: Iterable[tuple[str, torch.Tensor]] = iter_gguf_weights(reader, config)
        total = len(reader.tensors)
    else:
        config = hf_model_config(path)
        weights = iter_hf_weights(path)
        total = hf_tensor_count(path)
    # Build on the meta device so no time goes to random init of weights we overwrite.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.rope = model._rope_table().to(device)
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    bar = tqdm(
        total=total,
        desc=f"loading {path.name}",
        unit="tensor",
        disable=not show_progress,
        file=sys.stderr,
    )
    model.load_hf_weights(_counted(weights, bar))
    bar.close()
    model.eval()
    log.info(
        "model loaded",
        extra={"path": str(path), "dtype": str(dtype), "seconds": time.perf_counter() - started},
    )
    return model


def _counted(
    weights: Iterable[tuple[str, torch.Tensor]], bar: tqdm
) -> Iterator[tuple[str, torch.Tensor]]:
    for item in weights:
        yield item
        bar.update(1)
