"""Weight-only quantized linear layers in torch: int8 per channel, int4 in torch's CPU packed
layout, and NF4. Activations stay float; only the weights are stored in fewer bits.

    int8:  W[n, k] = w_q[n, k] · w_scale[n]                        (symmetric, per channel)
    int4:  W[n, k] = (q[n, k] - 8) · s[k // G, n] + z[k // G, n]   q in 0..15 (torch's layout:
           `packed` is opaque, from aten._convert_weight_to_int4pack_for_cpu; scales_and_zeros
           [K / G, N, 2] holds (s, z) in the activation dtype)
    nf4:   W[n, k] = NF4_LEVELS[q[n, k]] · absmax[n, k // G]       (QLoRA's normal-float codes)

On CPU, bf16/fp16 activations take torch's packed kernels (aten._weight_int8pack_mm,
aten._weight_int4pack_mm_for_cpu), which read the low-bit weights directly. fp32 activations
dequantize and call one matmul: the packed ops have no fast fp32 path (measured on the
SmolLM2 gate|up shape at batch 1: int8 packed 1.16 ms and int4 packed 4.6 ms in fp32 against
0.03 ms in bf16 and 0.3 ms for the fp32 matmul of the float weight).
NF4 has no torch kernel: it always dequantizes through a 16-entry table and calls a matmul.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8_MAX = 127.0
INT4_ZERO_POINT = 8
# torch's int4 CPU packing reads K in tiles of 16 * inner_k_tiles; 2 works for every K that
# is a multiple of 64 (all of SmolLM2's and Llama's dims).
INT4_INNER_K_TILES = 2
# The 16 NF4 levels: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero (QLoRA,
# Dettmers et al. 2023, appendix E).
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
_PACKED_DTYPES = (torch.bfloat16, torch.float16)


def _uses_packed_kernel(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _PACKED_DTYPES


# ---- int8, per output channel ----------------------------------------------------------


def quantize_int8_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (w_q int8 [N, K], w_scale fp32 [N]); symmetric per row."""
    w32 = weight.float()
    scale = w32.abs().amax(dim=-1) / INT8_MAX
    divisor = torch.where(scale == 0, 1.0, scale)[:, None]
    q = torch.round(w32 / divisor).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8_weight(w_q: Tensor, w_scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (w_q.float() * w_scale.float()[:, None]).to(dtype)


def int8_weight_only_gemm(x: Tensor, w_q: Tensor, w_scale: Tensor) -> Tensor:
    """x [M, K] float @ (w_q [N, K] int8 · w_scale [N])^T -> [M, N] in x.dtype.

    w_scale should already be in x.dtype (the packed kernel requires it; converting once at
    load time, not per call).
    """
    assert x.shape[-1] == w_q.shape[1], f"x {tuple(x.shape)}, w_q {tuple(w_q.shape)}"
    if _uses_packed_kernel(x):
        return torch.ops.aten._weight_int8pack_mm(x, w_q, w_scale.to(x.dtype))
    return x @ dequantize_int8_weight(w_q, w_scale, x.dtype).t()


# ---- int4, grouped along K, torch's CPU packed layout -----------------------------------


def quantize_int4_codes(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] -> (codes uint8 [N, K] in 0..15, scale fp32 [N, K/G], zero fp32 [N, K/G]).

    Asymmetric (min/max of each group), so W ≈ (code - 8) · scale + zero.
    """
    n, k = weight.shape
    assert k % group_size == 0, f"K {k} is not a multiple of the group size {group_size}"
    groups = weight.float().view(n, k // group_size, group_size)
    low = groups.amin(dim=-1)
    scale = (groups.amax(dim=-1) - low) / 15.0
    divisor = torch.where(scale == 0, 1.0, scale)
    codes = torch.round((groups - low[..., None]) / divisor[..., None]).clamp_(0, 15)
    zero = low + INT4_ZERO_POINT * scale
    return codes.to(torch.uint8).view(n, k), scale, zero


def dequantize_int4_codes(codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """Inverse of `quantize_int4_codes` in fp32 -> [N, K]."""
    n, k = codes.shape
    groups = codes.float().view(n, scale.shape[1], -1) - INT4_ZERO_POINT
    return (groups * scale.float()[..., None] + zero.float()[..., None]).view(n, k)


def pack_int4_for_cpu(
    codes: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(codes [N, K], scale/zero [N, K/G]) -> (packed, scales_and_zeros [K/G, N, 2] in dtype)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32), INT4_INNER_K_TILES
    )
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
    return packed, scales_and_zeros


def int4_packed_gemm(
    x: Tensor, packed: Tensor, scales_and_zeros: Tensor, group_size: int, codes: Tensor | None
) -> Tensor:
    """x [M, K] @ W^T -> [M, N]. `codes` [N, K] uint8 is only needed for fp32 activations
    (the dequantize path); pass None when the packed kernel serves every call."""
    if _uses_packed_kernel(x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, packed, group_size, scales_and_zeros.to(x.dtype)
        )
    assert codes is not None, "fp32 activations need the unpacked int4 codes"
    scale, zero = scales_and_zeros[..., 0].t(), scales_and_zeros[..., 1].t()
    return x @ dequantize_int4_codes(codes, scale, zero).to(x.dtype).t()


# ---- NF4 ---------------------------------------------------------------------------------


def quantize_nf4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (packed uint8 [N, K/2], absmax fp32 [N, K/G]).

    Each value goes to the nearest NF4 level of value / absmax(group); two codes per byte,
    low nibble = even k.
    """
    n, k = weight.shape
    assert k % group_size == 0 and k % 2 == 0, f"K {k}, group {group_size}"
    groups = weight.float().view(n, k // group_size, group_size)
    absmax = groups.abs().amax(dim=-1)
    normed = groups / torch.where(absmax == 0, 1.0, absmax)[..., None]
    levels = torch.tensor(NF4_LEVELS, device=weight.device)
    # Nearest level by midpoints: 15 boundaries, searchsorted gives the code directly.
    midpoints = (levels[1:] + levels[:-1]) / 2
    codes = torch.bucketize(normed.reshape(n, k), midpoints).to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), absmax


# byte -> (level of its low nibble, level of its high nibble): one gather unpacks two codes.
_NF4_BYTE_TABLE = torch.tensor([[NF4_LEVELS[b & 0xF], NF4_LEVELS[b >> 4]] for b in range(256)])


def dequantize_nf4(packed: Tensor, absmax: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of `quantize_nf4` -> [N, K] in `dtype` (the product is rounded to it once)."""
    n, half_k = packed.shape
    table = _NF4_BYTE_TABLE.to(device=packed.device, dtype=torch.float32)
    values = table.index_select(0, packed.reshape(-1).int()).view(n, absmax.shape[1], -1)
    return (values * absmax.float()[..., None]).view(n, 2 * half_k).to(dtype)


def nf4_gemm(x: Tensor, packed: Tensor, absmax: Tensor) -> Tensor:
    """x [M, K] @ dequant(W)^T -> [M, N] in x.dtype (dequantizes the whole weight per call:
    no torch kernel reads NF4 codes, so this is a memory format, not a fast one, on CPU)."""
    assert x.shape[-1] == 2 * packed.shape[1], f"x {tuple(x.shape)}, packed {packed.shape}"
    return x @ dequantize_nf4(packed, absmax, x.dtype).t()
