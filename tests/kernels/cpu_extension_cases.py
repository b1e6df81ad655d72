"""Shared inputs and checks for the C++ CPU kernel tests: decode cases shaped like the worker's
(caches are views of one [layers, 2, ...] storage, queries, keys and values are strided views
of a fused qkv output, block tables are wider than needed, the unused columns holding ids
outside the cache so reading one fails), and the decode and KV-write checks against the torch
references."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import attention_torch, kv_cache_torch

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GQA = [(4, 4), (9, 3), (8, 1)]
UNUSED_BLOCK = 2**30  # in block-table columns past a sequence's length


@dataclass(slots=True)
class DecodeCase:
    query: Tensor  # [B, Hq, D], a strided view of a fused qkv output
    k_cache: Tensor  # views of layer 1 of a [2, 2, num_blocks, block_size, Hkv, D] storage
    v_cache: Tensor
    block_tables: Tensor  # [B, W] int32, UNUSED_BLOCK past each sequence's blocks
    context_lens: Tensor  # [B] int32, 0 = padding row
    k_scale: Tensor | None
    v_scale: Tensor | None
    sliding_window: int = 0
    logit_softcap: float = 0.0

    @property
    def scale(self) -> float:
        return float(self.query.shape[-1] ** -0.5)

    def args(self) -> tuple:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.scale,
            self.k_scale,
            self.v_scale,
            False,  # batch_invariant
            self.sliding_window,
            self.logit_softcap,
        )

    def reference(self) -> Tensor:
        """The torch op on the non-padding rows; zeros for padding rows."""
        valid = self.context_lens > 0
        out = torch.zeros(self.query.shape, dtype=self.query.dtype)
        if bool(valid.any()):
            # The torch op gathers every column up to the longest context: hand it real ids.
            tables = self.block_tables[valid].clamp(max=self.k_cache.shape[0] - 1)
            out[valid] = attention_torch.paged_decode_attention(
                self.query[valid].contiguous(),
                self.k_cache,
                self.v_cache,
                tables,
                self.context_lens[valid],
                self.scale,
                self.k_scale,
                self.v_scale,
                sliding_window=self.sliding_window,
                logit_softcap=self.logit_softcap,
            )
        return out


def fused_qkv_views(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor, Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] as views into one [T, (Hq + 2 Hkv) * D] tensor."""
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.view(num_tokens, num_q_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


def make_decode_case(
    lengths: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    block_size: int = 16,
    quant_group: int | None = None,
    scale_dtype: torch.dtype = torch.float16,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    cache_dtype: torch.dtype | None = None,
) -> DecodeCase:
    """A decode case with a query in `dtype` over a cache in `cache_dtype` (default: `dtype`),
    or int8 with `quant_group` values per scale."""
    blocks_needed = [-(-n // block_size) for n in lengths]
    width = max(blocks_needed) + 3
    num_blocks = sum(blocks_needed) + 5
    shape = (2, 2, num_blocks, block_size, num_kv_heads, head_dim)
    storage = torch.randn(shape, generator=generator)
    k_scale = v_scale = None
    if quant_group is None:
        storage = storage.to(cache_dtype or dtype)
    else:
        codes, scales = kv_cache_torch.quantize_kv_int8(storage, quant_group, scale_dtype)
        # Own allocations (quantize returns reshaped views): the views' _base is the storage.
        storage, scales = codes.clone(), scales.clone()
        k_scale, v_scale = scales[1, 0], scales[1, 1]
    order = torch.randperm(num_blocks, generator=generator).int()
    block_tables = torch.full((len(lengths), width), UNUSED_BLOCK, dtype=torch.int32)
    used = 0
    for row, n in enumerate(blocks_needed):
        block_tables[row, :n] = order[used : used + n]
        used += n
    query, _, _ = fused_qkv_views(
        len(lengths), num_q_heads, num_kv_heads, head_dim, dtype, generator
    )
    return DecodeCase(
        query,
        storage[1, 0],
        storage[1, 1],
        block_tables,
        torch.tensor(lengths, dtype=torch.int32),
        k_scale,
        v_scale,
        sliding_window,
        logit_softcap,
    )


def check_decode(extension, case: DecodeCase, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    got = extension.paged_decode_attention(*case.args())
    assert got.dtype == case.query.dtype and got.shape == case.query.shape
    assert got.is_contiguous()
    expected = case.reference()
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
    padding = case.context_lens == 0
    assert bool((got[padding] == 0).all()), "a padding row must be zeros"


def seeded(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % 2**31)


def check_write(
    extension,
    g: torch.Generator,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    quant_group: int | None,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    scale_dtype: torch.dtype = torch.float16,
    num_tokens: int = 11,
) -> None:  # type: ignore[no-untyped-def]
    block_size, num_blocks = 16, 9
    _, key, value = fused_qkv_views(num_tokens, 9, num_kv_heads, head_dim, dtype, g)
    key[2].zero_()  # an all-zero row: scale 0, codes 0
    key[3, 0, :8] = 1e-30  # a scale that rounds to 0 in fp16
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[1, 5]] = -1  # padding tokens
    shape = (2, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if cache_dtype == torch.int8:
        assert quant_group is not None
        storage = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        scale_shape = (*shape[:-1], head_dim // quant_group)
        scales = torch.rand(scale_shape, generator=g).to(scale_dtype)
    else:
        storage = torch.randn(shape, generator=g).to(cache_dtype)
        scales = None
    expected_storage, expected_scales = storage.clone(), None if scales is None else scales.clone()

    def layer(t: Tensor | None, kv: int) -> Tensor | None:
        return None if t is None else t[1, kv]

    real = slots >= 0  # the torch op has no padding slots
    kv_cache_torch.write_kv_cache(
        key[real],
        value[real],
        expected_storage[1, 0],
        expected_storage[1, 1],
        slots[real],
        layer(expected_scales, 0),
        layer(expected_scales, 1),
    )
    extension.write_kv_cache(
        key, value, storage[1, 0], storage[1, 1], slots, layer(scales, 0), layer(scales, 1)
    )
    assert torch.equal(storage, expected_storage), "cache differs (every layer, K and V checked)"
    if scales is not None:
        assert expected_scales is not None
        assert torch.equal(scales, expected_scales), "scales differ"


def check_token_bitmask(extension, generator: torch.Generator) -> None:  # type: ignore[no-untyped-def]
    """apply_token_bitmask against a torch reference (bits unpacked, masked_fill): all-zero,
    all-one and mixed words, padded logits, some rows listed."""
    rows, width, vocab_size = 6, 1000, 990
    logits = torch.randn(rows, width, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, 32), dtype=torch.int32, generator=generator)
    kinds = torch.randint(0, 3, bitmask.shape, generator=generator)
    bitmask[kinds == 0], bitmask[kinds == 1] = 0, -1
    listed = [0, 2, 3, 5]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.bool().view(rows, -1)[:, :width]
    allowed[:, vocab_size:] = True
    expected = logits.clone()
    expected[listed] = expected[listed].masked_fill(~allowed[listed], float("-inf"))
    extension.apply_token_bitmask(logits, bitmask, torch.tensor(listed), vocab_size)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def check_argmax_rows(extension, generator: torch.Generator) -> int:  # type: ignore[no-untyped-def]
    """argmax_rows against torch.argmax(dim=-1): widths around the 16-lane blocks, ties (the
    first index wins, -0.0 equal to +0.0), rows of -inf, NaNs (the first NaN wins), infinities
    and a row stride wider than the row; returns cases run."""
    cases = 0
    for width in (1, 15, 16, 17, 100, 49152):
        logits = torch.randn(9, width + 3, generator=generator)[:, :width]
        if width > 1:
            logits[1, width // 2] = logits[1, 0] = logits[1].max() + 1  # a tie: index 0 wins
            logits[2] = 0.0
            logits[2, ::2] = -0.0
            logits[3, width - 1] = float("nan")
            logits[3, width // 3] = float("nan")
            logits[4, width // 2] = float("inf")
            logits[5, -1] = logits[5].max() + 1  # the last value: the tail past the blocks
        logits[6] = float("-inf")
        logits[7, 0] = float("nan")
        logits[8] = -(2.0**100)
        expected = logits.argmax(dim=-1)
        torch.testing.assert_close(extension.argmax_rows(logits), expected, rtol=0, atol=0)
        cases += 1
    return cases
