"""Read a Hugging Face model directory's (possibly sharded) safetensors, addressed to our
parameters by the family's names (config.json is read by services/worker/model/families/)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from services.contracts.errors import ModelLoadError
from services.worker.loader.weight_names import hf_part, is_norm
from services.worker.model.causal_lm import WeightPart
from services.worker.model.families.base import ModelFamily


def safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {directory}")
    return files


def iter_hf_weights(directory: Path, family: ModelFamily) -> Iterator[WeightPart]:
    from safetensors import safe_open

    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                where = hf_part(family, name)
                if where is None:
                    continue
                tensor = handle.get_tensor(name)
                if family.hf_norm_offset and is_norm(where.parameter):
                    # Computed once in fp32, as the reference computes (1 + w) at every call.
                    tensor = tensor.float() + family.hf_norm_offset
                yield WeightPart(*where, tensor)


def hf_tensor_count(directory: Path) -> int:
    from safetensors import safe_open

    count = 0
    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            count += len(list(handle.keys()))
    return count
