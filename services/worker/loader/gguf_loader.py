"""Read a GGUF file's weights (llama.cpp's format; the metadata readers are torch-free, in
services/common/gguf_metadata.py and services/contracts/model_config.py), dequantized to
float and renamed to Hugging Face names, with llama.cpp's Q/K row permutation undone."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from services.common.errors import ModelLoadError
from services.contracts.model_config import ModelConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves.

    llama.cpp stores each head's rows as (pairs of) interleaved halves [x0, x_{d/2}, x1, ...];
    Hugging Face's rotate_half wants [x0, x1, ..., | x_{d/2}, ...]. Rows are grouped per head:
    (heads, d/2, 2, ...) → swap → (heads, 2, d/2, ...).
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def iter_gguf_weights(reader: Any, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor in the file."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    permute_qk = config.architecture in ("llama", "mistral")
    for tensor in reader.tensors:
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.array(tensor.data, dtype=np.float32)  # copy: the file is mapped read-only
        else:
            array = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = array.reshape(shape)
        name = hf_tensor_name(tensor.name)
        if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = unpermute_rows(array, config.num_heads)
        elif permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = unpermute_rows(array, config.num_kv_heads)
        yield name, torch.from_numpy(np.ascontiguousarray(array))


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
