"""What a decoder-only model is made of: the switches of the one shared decoder
(services/worker/model/causal_lm.py), read from a Hugging Face config.json or a GGUF file's
metadata by the model's family (services/worker/model/families/). Torch-free.

Every field has the value of a plain Llama by default, so a family states only where it
differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

HiddenAct = Literal["silu", "gelu_tanh"]
QKNorm = Literal["none", "per_head", "across_heads"]


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding of one kind of layer."""

    theta: float = 10000.0
    scaling: dict[str, Any] | None = None
    """HF rope parameters when the type is not 'default': linear, llama3, yarn, longrope, or
    GGUF's per-frequency divisors ({'rope_type': 'divisors', 'divisors': [...]})."""
    partial_rotary_factor: float = 1.0
    """Fraction of head_dim that is rotated (the first dims of each head); the rest pass."""


@dataclass(frozen=True, slots=True)
class ModelArchitecture:
    family: str
    """The registry's name for the family (llama, qwen3, gemma2, ...)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    local_rope: RopeConfig | None = None
    """The rope of sliding-window layers when it differs from the global one (Gemma 3)."""
    attention_bias: bool = False
    """Biases on the q, k and v projections (Qwen2)."""
    qk_norm: QKNorm = "none"
    """RMSNorm of queries and keys before rope: per head (Qwen3, Gemma 3) or across the
    whole projection (OLMo 2)."""
    hidden_act: HiddenAct = "silu"
    pre_norms: bool = True
    """RMSNorm before attention and before the MLP (all but OLMo 2)."""
    post_norms: bool = False
    """RMSNorm of the attention and MLP outputs before the residual add (Gemma 2/3, OLMo 2)."""
    embedding_multiplier: float = 1.0
    """Embeddings are multiplied by it: sqrt(hidden) for Gemma (rounded to the model dtype)."""
    residual_multiplier: float = 1.0
    """Attention and MLP outputs are multiplied by it before the residual add (Granite)."""
    attention_scale: float | None = None
    """Query scale; None is head_dim ** -0.5."""
    attn_logit_softcap: float = 0.0
    """Scores become c * tanh(s / c) (Gemma 2); 0 is none."""
    final_logit_softcap: float = 0.0
    logits_divisor: float = 1.0
    """Logits are divided by it (Granite's logits_scaling)."""
    layer_sliding_windows: tuple[int, ...] = ()
    """Per layer, the keys a query sees (itself included); 0 is full attention. Empty: no
    layer has a window."""
    layer_uses_rope: tuple[bool, ...] = ()
    """Per layer, whether rope applies (SmolLM3 skips it on every fourth layer). Empty: all."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def query_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def sliding_window(self, layer: int) -> int:
        return self.layer_sliding_windows[layer] if self.layer_sliding_windows else 0

    def uses_rope(self, layer: int) -> bool:
        return self.layer_uses_rope[layer] if self.layer_uses_rope else True

    def rope_of_layer(self, layer: int) -> RopeConfig:
        if self.local_rope is not None and self.sliding_window(layer):
            return self.local_rope
        return self.rope

    @property
    def largest_window(self) -> int:
        """0 when some layer attends to the whole context."""
        windows = self.layer_sliding_windows
        if not windows or 0 in windows:
            return 0
        return max(windows)
