"""Rotary position embedding (Hugging Face "rotate_half" / NeoX convention) in torch."""

from __future__ import annotations

from torch import Tensor


def _rotate_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotates x [T, H, D] in place; cos/sin [T, 1, D/2] fp32."""
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

    cos_sin_cache [max_pos, D]: [:, :D/2] = cos, [:, D/2:] = sin (rope scaling already applied).
    Pairs are (i, i + D/2) over the full head dim. Math in fp32. Returns (query, key).
    """
    head_dim = query.shape[-1]
    assert key.shape[-1] == head_dim, f"key head_dim {key.shape[-1]} != query {head_dim}"
    assert cos_sin_cache.shape[-1] == head_dim, f"cos_sin_cache {tuple(cos_sin_cache.shape)}"
    cos_sin = cos_sin_cache.index_select(0, positions.long()).float().unsqueeze(1)
    cos, sin = cos_sin.chunk(2, dim=-1)
    _rotate_(query, cos, sin)
    _rotate_(key, cos, sin)
    return query, key
