"""What a model family declares, and the readers every family shares: the common fields of a
Hugging Face config.json and of a GGUF file's metadata, rope settings, and per-layer windows.

A family module builds a `ModelFamily` from these and states only where it differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.common.gguf_index import GGUFIndex
from services.contracts.errors import ModelLoadError
from services.worker.model.architecture import ModelArchitecture, RopeConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")

# Per-layer norm roles of the shared decoder (services/worker/model/causal_lm.py).
ATTN_NORM = "attn_norm"  # before attention
MLP_NORM = "mlp_norm"  # before the MLP
ATTN_OUT_NORM = "attn_out_norm"  # on the attention output (post-norm, sandwich)
MLP_OUT_NORM = "mlp_out_norm"  # on the MLP output

LLAMA_NORM_NAMES = {"input_layernorm": ATTN_NORM, "post_attention_layernorm": MLP_NORM}


@dataclass(frozen=True, slots=True)
class ModelFamily:
    name: str
    hf_model_types: tuple[str, ...]
    """config.json `model_type` values of this family."""
    gguf_architectures: tuple[str, ...]
    """GGUF `general.architecture` values of this family."""
    read_hf: Callable[[dict[str, Any]], ModelArchitecture]
    read_gguf: Callable[[GGUFMetadata], ModelArchitecture]
    hf_norm_names: dict[str, str] = field(default_factory=lambda: dict(LLAMA_NORM_NAMES))
    """Per-layer norm names of HF checkpoints -> the decoder's norm roles."""
    hf_norm_offset: float = 0.0
    """Added to every HF norm weight at load: Gemma stores w and computes with (1 + w);
    llama.cpp's converter already stored 1 + w, so GGUF files need nothing."""
    gguf_permuted_qk: bool = False
    """llama.cpp's converter interleaves the rotary halves of q/k rows (its 'normal' rope)."""
    gguf_fused_gate_up: bool = False
    """GGUF `ffn_up` holds gate and up stacked (Phi-3)."""


class GGUFMetadata:
    """`{architecture}.*` keys of a GGUF file, and its tensors, torch-free."""

    def __init__(self, index: GGUFIndex) -> None:
        self.index = index
        self.architecture = str(index.get("general.architecture"))
        self.tensor_names = set(index.by_name)

    def get(self, key: str, default: Any = None) -> Any:
        return self.index.get(f"{self.architecture}.{key}", default)

    def general(self, key: str, default: Any = None) -> Any:
        return self.index.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata {self.architecture}.{key} is missing")
        return value

    def tensor_values(self, name: str) -> list[float] | None:
        """A small float tensor's values (rope factors), or None when absent."""
        tensor = self.index.by_name.get(name)
        if tensor is None:
            return None
        return [float(v) for v in self.index.values(tensor).reshape(-1)]


# --- Hugging Face config.json ----------------------------------------------------------------


def hf_rope(
    params: dict[str, Any] | None, config: dict[str, Any], default_theta: float
) -> RopeConfig:
    """One rope from HF settings: transformers 5's `rope_parameters` entry, or the older
    `rope_theta` + `rope_scaling` (+ `partial_rotary_factor`) keys."""
    params = dict(params or {})
    theta = float(params.get("rope_theta") or config.get("rope_theta") or default_theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    partial = float(
        params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    )
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
        scaling["rope_type"] = kind
        # longrope and yarn derive their defaults from the context lengths.
        scaling.setdefault(
            "original_max_position_embeddings",
            config.get("original_max_position_embeddings") or config.get("max_position_embeddings"),
        )
        scaling.setdefault("max_position_embeddings", config.get("max_position_embeddings"))
    return RopeConfig(theta=theta, scaling=scaling, partial_rotary_factor=partial)


def hf_ropes(
    config: dict[str, Any], default_theta: float = 10000.0
) -> tuple[RopeConfig, RopeConfig | None]:
    """(global rope, rope of sliding layers if it has its own settings)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention")
        return (
            hf_rope(params["full_attention"], config, default_theta),
            hf_rope(local, config, default_theta) if local else None,
        )
    if not isinstance(params, dict):
        params = config.get("rope_scaling") or {}
    return hf_rope(params, config, default_theta), None


def hf_layer_windows(
    config: dict[str, Any], default_types: Callable[[int], str] | None = None
) -> tuple[int, ...]:
    """Per-layer sliding windows from `layer_types` (or the family's default pattern)."""
    window = config.get("sliding_window")
    num_layers = int(config["num_hidden_layers"])
    if not window:
        return ()
    types = config.get("layer_types")
    if types is None:
        if default_types is None:
            return ()
        types = [default_types(i) for i in range(num_layers)]
    if len(types) != num_layers:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {num_layers} layers")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def hf_architecture(family: str, config: dict[str, Any], **switches: Any) -> ModelArchitecture:
    """The fields every family reads the same way, plus the family's switches."""
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    if "rope" not in switches:
        switches["rope"], local = hf_ropes(config)
        if local is not None:
            switches.setdefault("local_rope", local)
    return ModelArchitecture(
        family=family,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        **switches,
    )


# --- GGUF metadata ---------------------------------------------------------------------------


def gguf_rope(meta: GGUFMetadata, head_dim: int) -> RopeConfig:
    """The global rope of a GGUF file: freq_base, linear/yarn scaling keys, and llama.cpp's
    per-frequency divisors (`rope_freqs`, Llama 3.1) when the file has them."""
    theta = float(meta.get("rope.freq_base", 10000.0))
    rotated = int(meta.get("rope.dimension_count", head_dim))
    partial = rotated / head_dim
    divisors = meta.tensor_values("rope_freqs.weight")
    if divisors is not None:
        return RopeConfig(theta, {"rope_type": "divisors", "divisors": divisors}, partial)
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return RopeConfig(theta, None, partial)
    factor = float(meta.get("rope.scaling.factor", 1.0))
    original = meta.get("rope.scaling.original_context_length")
    if kind == "linear":
        return RopeConfig(theta, {"rope_type": "linear", "factor": factor}, partial)
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(original),
            "max_position_embeddings": int(meta.get("context_length", 2048)),
            "beta_fast": meta.get("rope.scaling.yarn_beta_fast"),
            "beta_slow": meta.get("rope.scaling.yarn_beta_slow"),
        }
        return RopeConfig(theta, scaling, partial)
    raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn)")


def gguf_swa_windows(meta: GGUFMetadata, num_layers: int, default_pattern: int) -> tuple[int, ...]:
    """Per-layer windows as llama.cpp reads them: `attention.sliding_window` and a pattern
    (`attention.sliding_window_pattern`: a period n, layer i windowed when i % n < n - 1,
    or one flag per layer)."""
    window = int(meta.get("attention.sliding_window", 0) or 0)
    if window <= 0:
        return ()
    pattern = meta.get("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, Sequence) and not isinstance(pattern, str):
        flags = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        flags = [period <= 1 or i % period < period - 1 for i in range(num_layers)]
    return tuple(window if flag else 0 for flag in flags)


def gguf_windowed_reader(
    family: str, default_pattern: int = 1, **switches: Any
) -> Callable[[GGUFMetadata], ModelArchitecture]:
    """A family's GGUF reader: the common fields, the file's per-layer windows (llama.cpp's
    period `default_pattern` when the file gives none) and the family's fixed switches."""

    def read(meta: GGUFMetadata) -> ModelArchitecture:
        num_layers = int(meta.require("block_count"))
        windows = gguf_swa_windows(meta, num_layers, default_pattern)
        return gguf_architecture(family, meta, layer_sliding_windows=windows, **switches)

    return read


def gguf_architecture(family: str, meta: GGUFMetadata, **switches: Any) -> ModelArchitecture:
    num_heads = int(meta.require("attention.head_count"))
    hidden = int(meta.require("embedding_length"))
    head_dim = int(meta.get("attention.key_length", hidden // num_heads))
    num_kv = meta.get("attention.head_count_kv", num_heads)
    if isinstance(num_kv, Sequence):
        raise ModelLoadError("GGUF per-layer head_count_kv is not supported")
    tokens = meta.general("tokenizer.ggml.tokens")
    vocab_size = int(meta.get("vocab_size", len(tokens) if tokens is not None else 0))
    eos = meta.general("tokenizer.ggml.eos_token_id")
    eot = meta.general("tokenizer.ggml.eot_token_id")
    bos = meta.general("tokenizer.ggml.bos_token_id")
    switches.setdefault("rope", gguf_rope(meta, head_dim))
    return ModelArchitecture(
        family=family,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta.require("feed_forward_length")),
        num_layers=int(meta.require("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(meta.get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in meta.tensor_names,
        attention_bias="blk.0.attn_q.bias" in meta.tensor_names
        or "blk.0.attn_qkv.bias" in meta.tensor_names,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None)),
        **switches,
    )


def with_eos(arch: ModelArchitecture, extra: Sequence[int]) -> ModelArchitecture:
    return replace(arch, eos_token_ids=tuple(dict.fromkeys((*arch.eos_token_ids, *extra))))
