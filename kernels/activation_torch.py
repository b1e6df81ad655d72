"""Gated activations on a fused [gate | up] projection, in torch: SwiGLU (silu(gate) * up)
and GeGLU with the tanh approximation (Gemma)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def silu_and_mul(x: Tensor) -> Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up, [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """x [..., 2I] = [gate | up] -> gelu_tanh(gate) * up, [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
