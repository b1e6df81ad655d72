"""Read a GGUF file (llama.cpp's format): model config from metadata, weights dequantized to
float and renamed to Hugging Face names, with llama.cpp's Q/K row permutation undone."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.errors import ModelLoadError
from services.worker.model.config import SUPPORTED_ARCHITECTURES, ModelConfig

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


@functools.lru_cache(maxsize=4)
def open_gguf(path: Path) -> Any:
    """One parsed reader per file and process: parsing the metadata (49k token strings for
    SmolLM2) takes seconds, and the tokenizer and the config readers both need it."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises bare ValueErrors on bad magic/versions
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_model_config(reader: Any) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
        )

    def meta(name: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{name}", default)

    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = int(meta("vocab_size", len(tokens.data) if tokens is not None else 0))
    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {scaling_type!r} is not supported")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=str(arch),
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=rope_scaling,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
    )


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
