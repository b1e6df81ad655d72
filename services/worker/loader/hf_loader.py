"""Read a Hugging Face model directory's (possibly sharded) safetensors (config.json is read by
services/contracts/model_config.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from services.common.errors import ModelLoadError


def safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {directory}")
    return files


def iter_hf_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle.get_tensor(name)


def hf_tensor_count(directory: Path) -> int:
    from safetensors import safe_open

    count = 0
    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            count += len(list(handle.keys()))
    return count
