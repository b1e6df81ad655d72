"""Read a GGUF LoRA file as llama.cpp's convert_lora_to_gguf.py writes it:

    general.type = "adapter", adapter.type = "lora", adapter.lora.alpha (float32),
    general.architecture = the base model's
    blk.N.<tensor>.weight.lora_a  [rank, in]    (GGUF lists dims fastest-first: (in, rank))
    blk.N.<tensor>.weight.lora_b  [out, rank]

The converter runs the base model's own tensor transforms on the pair: for the families whose
q/k rows llama.cpp interleaves, lora_b's rows are permuted as the base weight's are, and undone
here as the base loader undoes them. llama.cpp scales each pair by alpha / rank (1 without an
alpha): the file keeps no rsLoRA flag."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from services.common.gguf_index import GGUFIndex
from services.contracts.errors import ModelLoadError
from services.worker.loader.gguf_loader import qk_heads, unpermute_rows
from services.worker.loader.weight_names import gguf_part
from services.worker.lora.adapter import SUPPORTED_MODULES, LoraAdapter, Target, target_of
from services.worker.lora.errors import LoraAdapterError
from services.worker.model.architecture import ModelArchitecture
from services.worker.model.families.base import ModelFamily

# llama.cpp's converter writes some families under another family's architecture.
_ARCHITECTURE_ALIASES = {"mistral": ("llama",)}
_SUFFIXES = {".lora_a": "A", ".lora_b": "B"}


def is_gguf_file(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def read_gguf_adapter(
    name: str, path: Path, family: ModelFamily, arch: ModelArchitecture
) -> LoraAdapter:
    """The adapter of a GGUF LoRA file, its tensors as float32 on the host."""
    try:
        index = GGUFIndex(path)
    except ModelLoadError as exc:
        raise LoraAdapterError("path", str(exc)) from exc
    _check_header(index, family)
    alpha = float(index.get("adapter.lora.alpha", 0.0) or 0.0)
    pairs: dict[Target, dict[str, np.ndarray]] = {}
    for tensor in index.tensors:
        target, which, base_name = _target(tensor.name, family)
        array = index.values(tensor)
        heads = qk_heads(family, arch, base_name, target.part) if which == "B" else 0
        if heads:
            array = unpermute_rows(array, heads)
        pairs.setdefault(target, {})[which] = array
    ranks = {pair["A"].shape[0] for pair in pairs.values() if "A" in pair}
    if len(ranks) > 1:
        raise LoraAdapterError("r", f"tensors of different ranks {sorted(ranks)}")
    rank = ranks.pop() if ranks else 0
    adapter = LoraAdapter(name, path, rank, alpha / rank if alpha and rank else 1.0)
    for target, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(
                "tensors", f"{target.module} of layer {target.layer} lacks lora_a or lora_b"
            )
        adapter.weights[target] = (_tensor(pair["A"]), _tensor(pair["B"]))
    return adapter


def _check_header(index: GGUFIndex, family: ModelFamily) -> None:
    kind = index.get("general.type")
    if kind != "adapter":
        raise LoraAdapterError("general.type", f"is {kind!r}: not an adapter file")
    adapter_type = index.get("adapter.type")
    if adapter_type != "lora":
        raise LoraAdapterError("adapter.type", f"{adapter_type!r} adapters are not supported")
    architecture = index.get("general.architecture")
    known = (*family.gguf_architectures, *_ARCHITECTURE_ALIASES.get(family.name, ()))
    if architecture not in known:
        raise LoraAdapterError(
            "general.architecture",
            f"the adapter is for {architecture!r}, the served model is {family.name!r}",
        )


def _target(name: str, family: ModelFamily) -> tuple[Target, str, str]:
    """(target, "A" or "B", our parameter name) of a tensor name."""
    base, dot, suffix = name.rpartition(".")
    which = _SUFFIXES.get(f"{dot}{suffix}")
    where = None
    if which is not None:
        try:
            where = gguf_part(family, base)
        except ModelLoadError:
            where = None
    target = target_of(*where) if where is not None else None
    if which is None or where is None or target is None:
        raise LoraAdapterError(
            "tensors",
            f"{name!r} is not supported: LoRA pairs (.lora_a, .lora_b) on"
            f" {', '.join(SUPPORTED_MODULES)} only",
        )
    return target, which, where.parameter


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
