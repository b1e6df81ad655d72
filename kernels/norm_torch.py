"""RMSNorm and fused residual-add + RMSNorm in torch (fp32 math, output in the input dtype)."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., H] * rsqrt(mean(x^2) + eps) * weight [H], computed in fp32."""
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    # In-place ops on the fp32 temporary: it is ours (a copy) unless x was already fp32.
    out = x32 * torch.rsqrt(variance + eps)
    out.mul_(weight.float())
    return out.to(x.dtype)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Returns (rms_norm(x + residual), x + residual).

    The sum is rounded to x.dtype before it is normalized, as Hugging Face Llama does (it adds
    in the model dtype), so the normed output matches the residual stream it came from.
    """
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
