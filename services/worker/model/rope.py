"""Rotary embedding tables: inverse frequencies (with rope scaling) -> a [max_pos, rotary_dim]
cos|sin table, the scaling's attention factor folded into it.

Scalings, as transformers computes them (modeling_rope_utils): linear, llama3, yarn,
longrope; and GGUF's per-frequency divisors (`rope_freqs`, how llama.cpp stores Llama 3.1's
scaling). LongRoPE picks its short factors for positions below the original context and its
long factors from there on: per position, so a sequence keeps the rotations its cached keys
were written with (transformers switches the whole sequence once it grows past the original
context; both agree below it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from services.contracts.errors import ModelLoadError
from services.worker.model.architecture import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def _base_frequencies(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings") or 8192)
    low_wavelen = original / low
    high_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or float(scaling["max_position_embeddings"]) / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = _base_frequencies(dim, theta)
    interpolation = extrapolation / factor
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope_attention_factor(scaling: dict[str, Any]) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or float(scaling["max_position_embeddings"]) / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    return torch.outer(positions, inv_freq)


def cos_sin_cache(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim]: cos in the first half of each row, sin in the second."""
    dim = rotary_dim(rope, head_dim)
    positions = torch.arange(max_positions, dtype=torch.float64)
    inv_freq = _base_frequencies(dim, rope.theta)
    scaling = rope.scaling or {}
    kind = scaling.get("rope_type", "default")
    attention_factor = 1.0
    if kind == "default":
        angles = _angles(positions, inv_freq)
    elif kind == "linear":
        angles = _angles(positions, inv_freq / float(scaling["factor"]))
    elif kind == "llama3":
        angles = _angles(positions, _llama3(inv_freq, scaling))
    elif kind == "divisors":
        divisors = torch.tensor(scaling["divisors"], dtype=torch.float64)
        angles = _angles(positions, inv_freq / divisors)
    elif kind == "yarn":
        yarn_freq, attention_factor = _yarn(dim, rope.theta, scaling)
        angles = _angles(positions, yarn_freq)
    elif kind == "longrope":
        attention_factor = _longrope_attention_factor(scaling)
        original = int(scaling["original_max_position_embeddings"])
        short = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)
        long = inv_freq / torch.tensor(scaling["long_factor"], dtype=torch.float64)
        angles = torch.where(
            (positions < original)[:, None], _angles(positions, short), _angles(positions, long)
        )
    else:
        raise ModelLoadError(f"rope scaling {kind!r} is not supported")
    table = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor
    return table.to(torch.float32)
