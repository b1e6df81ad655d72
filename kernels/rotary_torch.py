"""Rotary position embedding (Hugging Face "rotate_half" / NeoX convention) in torch."""

from __future__ import annotations

from torch import Tensor


def _rotate_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotates x [T, H, R] in place; cos/sin [T, 1, R/2] fp32."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].float()
    x2 = x[..., half:].float()
    # Both halves are computed before either is written: for fp32 inputs x1/x2 alias x.
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    x[..., :half] = out1
    x[..., half:] = out2


def apply_rotary(
    query: Tensor, key: Tensor, positions: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    """Rotates query [T, Hq, D] and key [T, Hkv, D] in place at `positions` [T].

    cos_sin_cache [max_pos, R], R <= D even: [:, :R/2] = cos, [:, R/2:] = sin (rope scaling
    already applied). The first R dims of each head are rotated, pairs (i, i + R/2); the
    other D - R pass through (partial rotary, e.g. Phi-4-mini). Math in fp32. Returns
    (query, key).
    """
    head_dim = query.shape[-1]
    rotary_dim = cos_sin_cache.shape[-1]
    assert key.shape[-1] == head_dim, f"key head_dim {key.shape[-1]} != query {head_dim}"
    assert rotary_dim <= head_dim and rotary_dim % 2 == 0, (
        f"cos_sin_cache {tuple(cos_sin_cache.shape)} for head_dim {head_dim}"
    )
    cos_sin = cos_sin_cache.index_select(0, positions.long()).float().unsqueeze(1)
    cos, sin = cos_sin.chunk(2, dim=-1)
    _rotate_(query[..., :rotary_dim], cos, sin)
    _rotate_(key[..., :rotary_dim], cos, sin)
    return query, key
