"""Token sampling in Triton without sorting the vocabulary: one program per row.

Same contract and filter definitions as `kernels.sampling_torch` (read its docstring). Each
threshold is found by bisection over the *order-preserving integer key* of fp32 values, so it
lands exactly on a logit value after at most 32 passes over the row, and no sort is needed:

    top-k:  the largest key t with count(x >= t) >= k
    top-p:  the smallest key t with Σ_{x > t, x >= t_k} e^(x - max) < p · Σ_{x >= t_k} e^(x - max)
    min-p:  max + log(min_p), directly

Then one more pass takes argmax(x - log E) over the survivors (the exponential race). A pass
costs V loads; disabled filters cost nothing. Rows with temperature <= 0 take the argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _ordered_key(x):
    """fp32 -> int64 key with the same order (negative floats have their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _load_scaled(row_ptr, offs, vocab, inv_t):
    x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    return x * inv_t


@triton.jit
def _sample_kernel(
    logits_ptr,  # [B, V]
    inv_temperature_ptr,  # [B] fp32, 1/T; <= 0 marks a greedy row
    top_k_ptr,  # [B] int
    top_p_ptr,  # [B] fp32
    min_p_ptr,  # [B] fp32
    exponentials_ptr,  # [B, V] fp32 Exp(1)
    out_ptr,  # [B] int64
    vocab,
    stride_l,
    stride_e,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    noise_ptr = exponentials_ptr + row * stride_e
    inv_t = tl.load(inv_temperature_ptr + row)
    greedy = inv_t <= 0.0
    inv_t = tl.where(greedy, 1.0, inv_t)
    offs = tl.arange(0, BLOCK_V)

    # Pass 1: max and min of the scaled row.
    x_max = float("-inf")
    x_min = float("inf")
    arg_max = 0
    for start in range(0, vocab, BLOCK_V):
        x = _load_scaled(row_ptr, start + offs, vocab, inv_t)
        tile_max = tl.max(x, axis=0)
        tile_arg = start + tl.argmax(x, axis=0)
        arg_max = tl.where(tile_max > x_max, tile_arg, arg_max)  # first index wins ties
        x_max = tl.maximum(x_max, tile_max)
        x_min = tl.minimum(x_min, tl.min(tl.where(start + offs < vocab, x, float("inf")), 0))
    if greedy:
        tl.store(out_ptr + row, arg_max.to(tl.int64))
        return

    threshold = _ordered_key(x_min)  # keeps everything
    top_k = tl.load(top_k_ptr + row)
    if (top_k > 0) & (top_k < vocab):
        lo = _ordered_key(x_min)  # count(x >= lo) = V >= k
        hi = _ordered_key(x_max)
        for _ in range(33):
            mid = (lo + hi + 1) >> 1
            count = 0
            for start in range(0, vocab, BLOCK_V):
                x = _load_scaled(row_ptr, start + offs, vocab, inv_t)
                ok = (_ordered_key(x) >= mid) & (start + offs < vocab)
                count += tl.sum(ok.to(tl.int32), axis=0)
            enough = count >= top_k
            lo = tl.where((lo < hi) & enough, mid, lo)
            hi = tl.where((lo < hi) & ~enough, mid - 1, hi)
        threshold = lo

    top_p = tl.load(top_p_ptr + row)
    if top_p < 1.0:
        total = 0.0
        for start in range(0, vocab, BLOCK_V):
            x = _load_scaled(row_ptr, start + offs, vocab, inv_t)
            total += tl.sum(tl.where(_ordered_key(x) >= threshold, tl.exp(x - x_max), 0.0), 0)
        budget = top_p * total
        lo = threshold
        hi = _ordered_key(x_max)  # mass above the max is 0 < budget
        for _ in range(33):
            mid = (lo + hi) >> 1
            above = 0.0
            for start in range(0, vocab, BLOCK_V):
                x = _load_scaled(row_ptr, start + offs, vocab, inv_t)
                key = _ordered_key(x)
                above += tl.sum(
                    tl.where((key > mid) & (key >= threshold), tl.exp(x - x_max), 0.0), 0
                )
            fits = above < budget
            hi = tl.where((lo < hi) & fits, mid, hi)
            lo = tl.where((lo < hi) & ~fits, mid + 1, lo)
        threshold = tl.maximum(threshold, hi)

    min_p = tl.load(min_p_ptr + row)
    if min_p > 0.0:
        threshold = tl.maximum(threshold, _ordered_key(x_max + tl.log(min_p)))

    # Final pass: the exponential race over the survivors.
    best = float("-inf")
    best_idx = 0
    for start in range(0, vocab, BLOCK_V):
        x = _load_scaled(row_ptr, start + offs, vocab, inv_t)
        noise = tl.load(noise_ptr + start + offs, mask=start + offs < vocab, other=1.0)
        score = tl.where(_ordered_key(x) >= threshold, x - tl.log(noise), float("-inf"))
        tile_best = tl.max(score, axis=0)
        tile_idx = start + tl.argmax(score, axis=0)
        best_idx = tl.where(tile_best > best, tile_idx, best_idx)
        best = tl.maximum(best, tile_best)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def sample_tokens(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    exponentials: Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    block_v: int = 4096,
) -> Tensor:
    """Same contract as `kernels.sampling_torch.sample_tokens`."""
    batch, vocab = logits.shape
    assert temperature.shape == top_k.shape == top_p.shape == min_p.shape == (batch,)
    assert logits.stride(1) == 1
    greedy = temperature <= 0
    if bool(greedy.all()):
        return logits.argmax(dim=-1)
    if exponentials is None:
        exponentials = torch.empty(batch, vocab, dtype=torch.float32, device=logits.device)
        exponentials.exponential_(generator=generator)
    assert exponentials.shape == (batch, vocab) and exponentials.stride(1) == 1
    # 1/T computed here exactly as the torch path does, so both scale logits identically.
    inv_temperature = torch.where(greedy, 0.0, 1.0 / temperature.float()).contiguous()
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    _sample_kernel[(batch,)](
        logits,
        inv_temperature,
        top_k.contiguous(),
        top_p.float().contiguous(),
        min_p.float().contiguous(),
        exponentials,
        out,
        vocab,
        logits.stride(0),
        exponentials.stride(0),
        BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
    )
    return out
