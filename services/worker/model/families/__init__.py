"""The model registry: every family llmserve serves, found by a Hugging Face config's
`model_type` or a GGUF file's `general.architecture`.

Adding a family: a module here that builds a `ModelFamily` (what it reads from config.json and
from GGUF metadata, and how its checkpoints name their norms), its entry in FAMILIES, and its
tests. The decoder itself (services/worker/model/causal_lm.py) is shared.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.common.gguf_index import GGUFIndex, open_gguf_index
from services.contracts.errors import ModelLoadError
from services.worker.model.architecture import ModelArchitecture
from services.worker.model.families.base import GGUFMetadata, ModelFamily
from services.worker.model.families.gemma import GEMMA, GEMMA2, GEMMA3
from services.worker.model.families.llama import GRANITE, LLAMA, MISTRAL, SMOLLM3
from services.worker.model.families.olmo2 import OLMO2
from services.worker.model.families.phi3 import PHI3
from services.worker.model.families.qwen import QWEN2, QWEN3

FAMILIES: tuple[ModelFamily, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    GEMMA,
    GEMMA2,
    GEMMA3,
    PHI3,
    GRANITE,
    SMOLLM3,
    OLMO2,
)
_BY_HF_TYPE = {t: f for f in FAMILIES for t in f.hf_model_types}
_BY_GGUF_ARCH = {a: f for f in FAMILIES for a in f.gguf_architectures}
# Multimodal checkpoints whose text model we could serve, and what to pass instead.
_WRAPPERS = {"gemma3": "its text model (Gemma3ForCausalLM, model_type gemma3_text)"}


def family_by_name(name: str) -> ModelFamily:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(name)


def hf_family(config: dict[str, Any]) -> ModelFamily:
    model_type = config.get("model_type")
    if model_type in _WRAPPERS:
        raise ModelLoadError(
            f"model_type {model_type!r} is multimodal; serve {_WRAPPERS[model_type]}"
        )
    family = _BY_HF_TYPE.get(str(model_type))
    if family is None:
        raise ModelLoadError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(_BY_HF_TYPE)})"
        )
    return family


def gguf_family(meta: GGUFMetadata) -> ModelFamily:
    family = _BY_GGUF_ARCH.get(meta.architecture)
    if family is None:
        raise ModelLoadError(
            f"GGUF architecture {meta.architecture!r} is not supported"
            f" (supported: {', '.join(_BY_GGUF_ARCH)})"
        )
    return family


def read_hf_config(directory: Path) -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    return config


def hf_model_architecture(directory: Path) -> tuple[ModelFamily, ModelArchitecture]:
    config = read_hf_config(directory)
    family = hf_family(config)
    architecture = family.read_hf(config)
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            extra = tuple(eos) if isinstance(eos, list) else (eos,)
            merged = tuple(dict.fromkeys((*architecture.eos_token_ids, *extra)))
            architecture = replace(architecture, eos_token_ids=merged)
    return family, architecture


def gguf_model_architecture(index: GGUFIndex) -> tuple[ModelFamily, ModelArchitecture]:
    meta = GGUFMetadata(index)
    family = gguf_family(meta)
    return family, family.read_gguf(meta)


def model_architecture(path: Path) -> tuple[ModelFamily, ModelArchitecture]:
    """The family and architecture of a .gguf file or a Hugging Face directory."""
    if path.suffix == ".gguf":
        return gguf_model_architecture(open_gguf_index(path))
    return hf_model_architecture(path)
