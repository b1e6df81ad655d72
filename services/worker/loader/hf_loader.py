"""Read a Hugging Face model directory: config.json and (possibly sharded) safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from services.common.errors import ModelLoadError
from services.worker.model.config import ModelConfig


def hf_model_config(directory: Path) -> ModelConfig:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    model_config = ModelConfig.from_hf(config)
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            extra = tuple(eos) if isinstance(eos, list) else (eos,)
            merged = tuple(dict.fromkeys((*model_config.eos_token_ids, *extra)))
            from dataclasses import replace

            model_config = replace(model_config, eos_token_ids=merged)
    return model_config


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
