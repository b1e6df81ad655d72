"""Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors), as peft's
`save_pretrained` writes it: tensors `base_model.model.<module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r], addressed to our projections by the family's checkpoint names.

What plain LoRA does not cover is refused, naming the config field: DoRA, biases, extra
trained modules, per-module ranks or alphas, embedding or output-layer targets."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from services.contracts.errors import ModelLoadError
from services.worker.loader.weight_names import hf_part
from services.worker.lora.adapter import SUPPORTED_MODULES, LoraAdapter, Target, target_of
from services.worker.lora.errors import LoraAdapterError
from services.worker.model.families.base import ModelFamily

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# Config fields whose non-empty value asks for more than plain LoRA on linear layers.
_REFUSED_WHEN_SET = {
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "adapters that train whole modules are not supported",
    "lora_bias": "LoRA biases are not supported",
    "fan_in_fan_out": "Conv1D (fan_in_fan_out) layers are not supported",
    "rank_pattern": "per-module ranks are not supported",
    "alpha_pattern": "per-module alphas are not supported",
    "trainable_token_indices": "trained token embeddings are not supported",
    "target_parameters": "LoRA on parameters (not modules) is not supported",
    "layer_replication": "layer replication is not supported",
}
_EMBEDDING_TARGETS = ("embed_tokens", "lm_head", "wte", "word_embeddings")


def is_peft_dir(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_peft_config(directory: Path) -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoraAdapterError("path", f"cannot read {directory / CONFIG_FILE}: {exc}") from exc
    return config


def check_peft_config(config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraAdapterError("peft_type", f"{peft_type!r} adapters are not supported (LORA)")
    for key, reason in _REFUSED_WHEN_SET.items():
        if config.get(key):
            raise LoraAdapterError(key, reason)
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise LoraAdapterError("bias", f"bias {bias!r} is not supported (only 'none')")
    targets = config.get("target_modules") or ()
    if isinstance(targets, str):
        targets = (targets,)  # a regex or "all-linear": checked tensor by tensor
    for module in targets:
        if any(module.endswith(name) for name in _EMBEDDING_TARGETS):
            raise LoraAdapterError(
                "target_modules",
                f"{module!r} is not supported: LoRA on {', '.join(SUPPORTED_MODULES)} only",
            )


def peft_scaling(config: dict[str, Any]) -> tuple[int, float]:
    """(rank, scaling): alpha / r, or alpha / sqrt(r) with use_rslora."""
    rank = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", 8))
    if rank <= 0:
        raise LoraAdapterError("r", f"must be positive, got {rank}")
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def read_peft_adapter(name: str, directory: Path, family: ModelFamily) -> LoraAdapter:
    """The adapter of a PEFT directory, its tensors as float32 on the host."""
    from safetensors import safe_open

    config = read_peft_config(directory)
    check_peft_config(config)
    rank, scaling = peft_scaling(config)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraAdapterError(
            "path", f"{weights_path} is missing (only safetensors weights are read)"
        )
    pairs: dict[Target, dict[str, Any]] = {}
    with safe_open(str(weights_path), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
            target, which = _target(key, family)
            pairs.setdefault(target, {})[which] = handle.get_tensor(key)
    adapter = LoraAdapter(name, directory, rank, scaling)
    for target, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(
                "weights", f"{target.module} of layer {target.layer} lacks its lora_A or lora_B"
            )
        adapter.weights[target] = (pair["A"].float(), pair["B"].float())
    return adapter


def _target(key: str, family: ModelFamily) -> tuple[Target, str]:
    """Where a tensor goes, and whether it is A or B."""
    match = _KEY_RE.match(key)
    if match is None:
        if "lora_magnitude_vector" in key:
            raise LoraAdapterError("use_dora", "DoRA adapters are not supported")
        if "lora_embedding" in key:
            raise LoraAdapterError("target_modules", "LoRA on embeddings is not supported")
        raise LoraAdapterError("weights", f"unexpected tensor {key!r} (not lora_A / lora_B)")
    module = match["module"]
    try:
        where = hf_part(family, f"{module}.weight")
    except ModelLoadError:
        where = None
    target = target_of(*where) if where is not None else None
    if target is None:
        raise LoraAdapterError(
            "target_modules",
            f"{module!r} is not supported: LoRA on {', '.join(SUPPORTED_MODULES)} only",
        )
    return target, match["ab"]
