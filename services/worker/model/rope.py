"""Rotary embedding tables: inverse frequencies (with rope scaling) → a [max_pos, D] cos|sin."""

from __future__ import annotations

import math
from typing import Any

import torch

from services.common.errors import ModelLoadError


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ModelLoadError(f"rope scaling {kind!r} is not supported (default, linear, llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = original / low
    high_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict[str, Any] | None,
    *,
    rope_freqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim]: cos in the first half of each row, sin in the second.

    `rope_freqs` (GGUF's per-frequency divisors for Llama 3 scaling) replaces `scaling`.
    """
    inv_freq = inverse_frequencies(head_dim, theta, None if rope_freqs is not None else scaling)
    if rope_freqs is not None:
        inv_freq = inv_freq / rope_freqs.to(torch.float64)
    positions = torch.arange(max_positions, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32)
