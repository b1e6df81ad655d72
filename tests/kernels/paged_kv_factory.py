"""Builders for random paged KV caches and packed batches, shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.kv_cache_torch import dequantize_kv_int8, quantize_kv_int8


@dataclass(slots=True)
class PagedKV:
    k_cache: Tensor  # [num_blocks, block_size, Hkv, D], float or int8
    v_cache: Tensor
    block_tables: Tensor  # [S, max_blocks] int32, padded with block 0
    lens: Tensor  # [S] int32, tokens each sequence holds in the cache
    k_scale: Tensor | None = None  # [num_blocks, block_size, Hkv, D // 8] when int8
    v_scale: Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def dense_kv(self, seq: int) -> tuple[Tensor, Tensor]:
        """The sequence's cached K and V, [len, Hkv, D] fp64, read slot by slot."""
        n = int(self.lens[seq])
        bs = self.block_size
        slots = [int(self.block_tables[seq, p // bs]) * bs + p % bs for p in range(n)]
        out = []
        for cache, scale in ((self.k_cache, self.k_scale), (self.v_cache, self.v_scale)):
            flat = cache.flatten(0, 1)[slots]
            if scale is not None:
                flat = dequantize_kv_int8(flat, scale.flatten(0, 1)[slots])
            out.append(flat.double())
        return out[0], out[1]


def make_paged_kv(
    lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    quantized: bool = False,
    spare_blocks: int = 3,
) -> PagedKV:
    """Random caches with each sequence's blocks at shuffled block ids; every slot (used or
    not) holds random data, so a kernel reading the wrong slot gets a wrong answer."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(max(blocks_per_seq), 1) + 1  # one padding column at least
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=generator)
    v = torch.randn(shape, generator=generator)
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = order[used : used + n].int()
        used += n
    lens_t = torch.tensor(lens, dtype=torch.int32)
    if quantized:
        k_q, k_s = quantize_kv_int8(k)
        v_q, v_s = quantize_kv_int8(v)
        return PagedKV(k_q, v_q, block_tables, lens_t, k_s, v_s)
    return PagedKV(k.to(dtype), v.to(dtype), block_tables, lens_t)


def ref_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, q_offset: int) -> Tensor:
    """Naive causal attention in fp64, one head at a time.

    q [n, Hq, D] at positions q_offset .. q_offset + n - 1; k/v [L, Hkv, D] at 0 .. L - 1.
    """
    n, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_q_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(n):
            visible = q_offset + i + 1
            scores = (kh[:visible] @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(scores, dim=0) @ vh[:visible]
    return out


def masked_ref_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    q_offset: int,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> Tensor:
    """Dense attention in fp64 with an explicit [n, L] mask, all heads at once.

    q [n, Hq, D] at positions p = q_offset .. q_offset + n - 1; k/v [L, Hkv, D] at 0 .. L - 1.
    Key j is visible to p when j <= p and, with a window W > 0, j > p - W (transformers'
    sliding_window_overlay). logit_softcap c > 0: scores c * tanh(scores / c) before the mask.
    """
    num_q_heads = q.shape[1]
    group = num_q_heads // k.shape[1]
    q_pos = torch.arange(q.shape[0])[:, None] + q_offset
    k_pos = torch.arange(k.shape[0])[None, :]
    mask = k_pos <= q_pos
    if sliding_window > 0:
        mask &= k_pos > q_pos - sliding_window
    keys = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    values = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys) * scale
    if logit_softcap > 0:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), values)
