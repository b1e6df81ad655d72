"""The switches of a ModelArchitecture that are on (those that differ from a plain Llama),
as JSON-ready values: what `llmserve inspect` prints about a model. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.worker.model.architecture import ModelArchitecture


def architecture_switches(arch: ModelArchitecture) -> dict[str, Any]:
    """The switches of `arch` that are on (that differ from a plain Llama), JSON-ready."""
    switches: dict[str, Any] = {}
    if arch.layer_sliding_windows:
        switches["sliding_window"] = window_pattern(arch.layer_sliding_windows)
    if arch.qk_norm != "none":
        switches["qk_norm"] = arch.qk_norm
    if not arch.pre_norms:
        switches["pre_norms"] = False
    if arch.post_norms:
        switches["post_norms"] = True
    if arch.attn_logit_softcap:
        switches["attn_logit_softcap"] = arch.attn_logit_softcap
    if arch.final_logit_softcap:
        switches["final_logit_softcap"] = arch.final_logit_softcap
    if arch.rope.scaling:
        switches["rope_scaling"] = _rope_scaling(arch.rope.scaling)
    if arch.local_rope is not None:
        local = {"theta": arch.local_rope.theta}
        if arch.local_rope.scaling:
            local.update(_rope_scaling(arch.local_rope.scaling))
        switches["local_rope"] = local
    if arch.rope.partial_rotary_factor != 1.0:
        switches["partial_rotary_factor"] = arch.rope.partial_rotary_factor
    if arch.layer_uses_rope and not all(arch.layer_uses_rope):
        switches["layers_without_rope"] = [i for i, r in enumerate(arch.layer_uses_rope) if not r]
    if arch.tie_word_embeddings:
        switches["tied_embeddings"] = True
    if arch.attention_bias:
        switches["attention_bias"] = True
    if arch.hidden_act != "silu":
        switches["hidden_act"] = arch.hidden_act
    if arch.embedding_multiplier != 1.0:
        switches["embedding_multiplier"] = arch.embedding_multiplier
    if arch.residual_multiplier != 1.0:
        switches["residual_multiplier"] = arch.residual_multiplier
    if arch.attention_scale is not None:
        switches["attention_scale"] = arch.attention_scale
    if arch.logits_divisor != 1.0:
        switches["logits_divisor"] = arch.logits_divisor
    return switches


def _rope_scaling(scaling: dict[str, Any]) -> dict[str, Any]:
    """The type and the headline numbers (the factor lists of longrope and GGUF's divisors
    are left out)."""
    summary: dict[str, Any] = {"type": scaling.get("rope_type", "default")}
    if scaling.get("factor") is not None:
        summary["factor"] = float(scaling["factor"])
    if scaling.get("original_max_position_embeddings") is not None:
        summary["original_context_length"] = int(scaling["original_max_position_embeddings"])
    return summary


def window_pattern(windows: Sequence[int]) -> dict[str, Any]:
    """Per-layer windows as a pattern: the window sizes, how many layers have one, the
    shortest period that repeats over all layers (None: no period shorter than the model),
    and the layers with full attention."""
    num_layers = len(windows)
    period = next(
        (
            p
            for p in range(1, num_layers)
            if all(windows[i] == windows[i % p] for i in range(num_layers))
        ),
        None,
    )
    return {
        "sizes": sorted({w for w in windows if w}),
        "windowed_layers": sum(1 for w in windows if w),
        "num_layers": num_layers,
        "period": period,
        "full_attention_layers": [i for i, w in enumerate(windows) if not w],
    }
