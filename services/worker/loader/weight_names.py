"""Checkpoint tensor names -> the shared decoder's parameters (services/worker/model/
causal_lm.py), for Hugging Face checkpoints (norm names per family) and GGUF files
(llama.cpp's names, the same for every architecture).

    ours (layers.N.)       HF (model.layers.N.)           GGUF (blk.N.)
    attn_norm              (the family's name)            attn_norm
    mlp_norm               (the family's name)            ffn_norm
    attn_out_norm          (the family's name)            post_attention_norm
    mlp_out_norm           (the family's name)            post_ffw_norm
    self_attn.qkv_proj     q_proj | k_proj | v_proj,      attn_q | attn_k | attn_v,
                           or qkv_proj (Phi-3)            or attn_qkv
    self_attn.o_proj       o_proj                         attn_output
    self_attn.q_norm       q_norm (k_norm alike)          attn_q_norm (attn_k_norm alike)
    mlp.gate_up_proj       gate_proj | up_proj,           ffn_gate | ffn_up,
                           or gate_up_proj (Phi-3)        or ffn_up (Phi-3)
    mlp.down_proj          down_proj                      ffn_down
    and embed_tokens.weight, norm, lm_head.weight: model.embed_tokens.weight,
    model.norm.weight, lm_head.weight in HF; token_embd, output_norm, output in GGUF.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from services.contracts.errors import ModelLoadError
from services.worker.model.families.base import (
    ATTN_NORM,
    ATTN_OUT_NORM,
    MLP_NORM,
    MLP_OUT_NORM,
    ModelFamily,
)


class PartName(NamedTuple):
    """Where a checkpoint tensor goes: `parameter`, whole or as part `part` of `num_parts`."""

    parameter: str
    part: int = 0
    num_parts: int = 1


_QKV = "self_attn.qkv_proj"
_GATE_UP = "mlp.gate_up_proj"
_HF_PROJECTIONS = {
    "self_attn.q_proj": (_QKV, 0, 3),
    "self_attn.k_proj": (_QKV, 1, 3),
    "self_attn.v_proj": (_QKV, 2, 3),
    "self_attn.qkv_proj": (_QKV, 0, 1),
    "self_attn.o_proj": ("self_attn.o_proj", 0, 1),
    "mlp.gate_proj": (_GATE_UP, 0, 2),
    "mlp.up_proj": (_GATE_UP, 1, 2),
    "mlp.gate_up_proj": (_GATE_UP, 0, 1),
    "mlp.down_proj": ("mlp.down_proj", 0, 1),
}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_SKIPPED = ("rotary_emb.inv_freq",)

_GGUF_GLOBAL = {
    "token_embd.weight": PartName("embed_tokens.weight"),
    "output_norm.weight": PartName("norm"),
    "output.weight": PartName("lm_head.weight"),
}
# Rope settings stored as tensors; read into the architecture (families/base.py, phi3.py).
GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_GGUF_LAYER = {
    "attn_norm": (ATTN_NORM, 0, 1),
    "ffn_norm": (MLP_NORM, 0, 1),
    "post_attention_norm": (ATTN_OUT_NORM, 0, 1),
    "post_ffw_norm": (MLP_OUT_NORM, 0, 1),
    "attn_q_norm": ("self_attn.q_norm", 0, 1),
    "attn_k_norm": ("self_attn.k_norm", 0, 1),
    "attn_q": (_QKV, 0, 3),
    "attn_k": (_QKV, 1, 3),
    "attn_v": (_QKV, 2, 3),
    "attn_qkv": (_QKV, 0, 1),
    "attn_output": ("self_attn.o_proj", 0, 1),
    "ffn_gate": (_GATE_UP, 0, 2),
    "ffn_up": (_GATE_UP, 1, 2),
    "ffn_down": ("mlp.down_proj", 0, 1),
}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_NORM_ROLES = (ATTN_NORM, MLP_NORM, ATTN_OUT_NORM, MLP_OUT_NORM)


def is_norm(parameter: str) -> bool:
    return parameter == "norm" or parameter.endswith((*_NORM_ROLES, "q_norm", "k_norm"))


def hf_part(family: ModelFamily, name: str) -> PartName | None:
    """Where a HF checkpoint tensor goes; None for tensors we do not load (rope caches)."""
    if name.endswith(_HF_SKIPPED):
        return None
    if name == "model.embed_tokens.weight":
        return PartName("embed_tokens.weight")
    if name == "model.norm.weight":
        return PartName("norm")
    if name == "lm_head.weight":
        return PartName("lm_head.weight")
    match = _HF_LAYER_RE.match(name)
    if match is None:
        raise ModelLoadError(f"unexpected weight {name!r} for the {family.name} family")
    layer, module, kind = match.groups()
    prefix = f"layers.{layer}"
    if module in _HF_PROJECTIONS:
        parameter, part, num_parts = _HF_PROJECTIONS[module]
        return PartName(f"{prefix}.{parameter}.{kind}", part, num_parts)
    if module in ("self_attn.q_norm", "self_attn.k_norm"):
        return PartName(f"{prefix}.{module}")
    if module in family.hf_norm_names:
        return PartName(f"{prefix}.{family.hf_norm_names[module]}")
    raise ModelLoadError(f"unexpected weight {name!r} for the {family.name} family")


def gguf_part(family: ModelFamily, name: str) -> PartName | None:
    """Where a GGUF tensor goes; None for rope tensors (read as settings)."""
    if name in GGUF_ROPE_TENSORS:
        return None
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    match = _GGUF_LAYER_RE.match(name)
    if match is None or match.group(2) not in _GGUF_LAYER:
        raise ModelLoadError(f"unexpected GGUF tensor {name!r} for the {family.name} family")
    layer, short, kind = match.groups()
    parameter, part, num_parts = _GGUF_LAYER[short]
    if short == "ffn_up" and family.gguf_fused_gate_up:
        part, num_parts = 0, 1
    suffix = f".{kind}" if not is_norm(parameter) else ""
    if is_norm(parameter) and kind != "weight":
        raise ModelLoadError(f"unexpected GGUF tensor {name!r}: a norm with a {kind}")
    return PartName(f"layers.{layer}.{parameter}{suffix}", part, num_parts)
