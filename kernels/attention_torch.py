"""Paged attention in torch: batched decode over the paged KV cache, varlen causal prefill.

These are the CPU path of the worker and the oracle for the Triton kernels.

Decode gathers each sequence's blocks into a dense [B, L, Hkv, D] tensor (L = the longest
context rounded up to a block), masks positions past each context length, and runs one SDPA
call. GQA costs nothing extra: the G = Hq / Hkv query heads sharing a KV head are laid out as
G query *rows* of that KV head, so K/V are never repeated:

    query [B, Hq, D] -> [B, Hkv, G, D]  (rows)   x   K [B, Hkv, L, D]  ->  [B, Hkv, G, L]

Measured on 2 CPU cores (kernels/README.md) for B in {1, 32, 64} x context in {128, 1024}:
fastest in bf16 against an explicit matmul + softmax and SDPA with enable_gqa, and level with
enable_gqa in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.kv_cache_torch import dequantize_kv_int8


def _gather_blocks(
    cache: Tensor, scale: Tensor | None, block_ids: Tensor, dtype: torch.dtype
) -> Tensor:
    """cache[block_ids] flattened over (blocks, offsets): [..., n * block_size, Hkv, D]."""
    # index_select, not cache[block_ids]: advanced indexing with a 2-D index is ~20x slower
    # on CPU (measured: 8 ms vs 0.4 ms for 10 blocks of a 1 GiB cache).
    flat_ids = block_ids.reshape(-1)
    blocks = cache.index_select(0, flat_ids).view(*block_ids.shape, *cache.shape[1:])
    if cache.dtype == torch.int8:
        assert scale is not None, "an int8 KV cache needs its scales"
        scales = scale.index_select(0, flat_ids).view(*block_ids.shape, *scale.shape[1:])
        blocks = dequantize_kv_int8(blocks, scales, dtype)
    elif blocks.dtype != dtype:
        blocks = blocks.to(dtype)
    return blocks.flatten(-4, -3)


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    *,
    batch_invariant: bool = False,
) -> Tensor:
    """One query token per sequence attending to its paged context.

    query [B, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D] (int8 with k_scale/
    v_scale [num_blocks, block_size, Hkv, D // group]); block_tables [B, max_blocks] int32;
    context_lens [B] int32 >= 1 (the current token's K/V is already in the cache).
    Returns [B, Hq, D] in query's dtype. batch_invariant: one call per sequence, cut to its
    own length, so no row's arithmetic depends on the others' lengths.
    """
    if batch_invariant and query.shape[0] > 1:
        rows = [
            paged_decode_attention(
                query[b : b + 1],
                k_cache,
                v_cache,
                block_tables[b : b + 1],
                context_lens[b : b + 1],
                scale,
                k_scale,
                v_scale,
            )
            for b in range(query.shape[0])
        ]
        return torch.cat(rows)
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} % Hkv {num_kv_heads} != 0"
    assert block_tables.shape[0] == batch and context_lens.shape == (batch,)
    group = num_q_heads // num_kv_heads
    # Only gather as many blocks as the longest context needs (one host sync; fine on CPU).
    longest = int(context_lens.max())
    num_blocks = (longest + block_size - 1) // block_size
    block_ids = block_tables[:, :num_blocks].long()
    keys = _gather_blocks(k_cache, k_scale, block_ids, query.dtype)  # [B, L, Hkv, D]
    values = _gather_blocks(v_cache, v_scale, block_ids, query.dtype)
    valid: Tensor | None = None
    if batch == 1 or bool((context_lens == longest).all()):
        # One length for all (always at batch 1): cut the keys to it and skip the mask;
        # SDPA's unmasked CPU path is ~1.6x faster on short contexts.
        keys, values = keys[:, :longest], values[:, :longest]
    else:
        positions = torch.arange(keys.shape[1], device=query.device)
        valid = (positions[None, :] < context_lens.to(positions.dtype)[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query.view(batch, num_kv_heads, group, head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=valid,
        scale=scale,
    )
    return out.reshape(batch, num_q_heads, head_dim)


def prefill_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    prefix_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Causal attention for S packed sequences' new tokens over (cached prefix + new tokens).

    query [T, Hq, D]; key/value [T, Hkv, D] (this chunk's tokens, not read back from the
    cache); cu_seqlens_q [S+1] int32; prefix_lens [S] int32 tokens already cached, read via
    block_tables [S, max_blocks]. New token i of a sequence sits at position prefix_len + i and
    sees keys 0 ..= prefix_len + i. Returns [T, Hq, D].
    """
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert key.shape == (num_tokens, num_kv_heads, head_dim), f"key {tuple(key.shape)}"
    assert value.shape == key.shape, f"value {tuple(value.shape)}"
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} % Hkv {num_kv_heads} != 0"
    gqa = num_q_heads != num_kv_heads
    starts = cu_seqlens_q.tolist()
    prefixes = prefix_lens.tolist()
    assert len(starts) == len(prefixes) + 1 and starts[-1] == num_tokens
    out = torch.empty_like(query)
    fresh = [s for s, p in enumerate(prefixes) if p == 0 and starts[s + 1] > starts[s]]
    batched = _fresh_prefills_batched(query, key, value, starts, fresh, scale, gqa, out)
    for seq, prefix_len in enumerate(prefixes):
        start, end = starts[seq], starts[seq + 1]
        if end == start or seq in batched:
            continue
        q = query[start:end].transpose(0, 1)  # [Hq, n, D]
        k = key[start:end]
        v = value[start:end]
        if prefix_len == 0:
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1),
                v.transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            )
        else:
            num_blocks = (prefix_len + block_size - 1) // block_size
            block_ids = block_tables[seq, :num_blocks].long()
            k = torch.cat([_gather_blocks(k_cache, k_scale, block_ids, k.dtype)[:prefix_len], k])
            v = torch.cat([_gather_blocks(v_cache, v_scale, block_ids, v.dtype)[:prefix_len], v])
            # SDPA's is_causal aligns the diagonal top-left; with a prefix it must be
            # bottom-right, so the mask is explicit.
            q_pos = torch.arange(prefix_len, prefix_len + end - start, device=query.device)
            k_pos = torch.arange(prefix_len + end - start, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )
        out[start:end] = o.transpose(0, 1)
    return out


def _fresh_prefills_batched(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    starts: list[int],
    seqs: list[int],
    scale: float,
    gqa: bool,
    out: Tensor,
) -> set[int]:
    """One SDPA call for several prefills without a cached prefix; returns the ones done.

    Per-sequence calls leave the second core idle on short prompts: measured on 2 cores,
    32 x 128 tokens 23 -> 17 ms and 8 x 1024 tokens 264 -> 100 ms per layer (bf16). Unequal
    lengths are padded (with a key-length mask) unless padding would exceed a third.
    """
    if len(seqs) < 2:
        return set()
    lengths = [starts[s + 1] - starts[s] for s in seqs]
    longest = max(lengths)
    if 3 * len(seqs) * longest > 4 * sum(lengths):
        return set()
    count = len(seqs)
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    first, last = starts[seqs[0]], starts[seqs[-1] + 1]
    same_length = all(n == longest for n in lengths)
    contiguous = seqs == list(range(seqs[0], seqs[-1] + 1))
    if same_length and contiguous:
        # Packed back to back with one length: the batch is a view, no copies.
        q = query[first:last].view(count, longest, num_q_heads, head_dim)
        k = key[first:last].view(count, longest, num_kv_heads, head_dim)
        v = value[first:last].view(count, longest, num_kv_heads, head_dim)
        mask = None
    else:
        q = query.new_zeros(count, longest, num_q_heads, head_dim)
        k = key.new_zeros(count, longest, num_kv_heads, head_dim)
        v = value.new_zeros(count, longest, num_kv_heads, head_dim)
        for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            q[row, :n] = query[starts[seq] : starts[seq] + n]
            k[row, :n] = key[starts[seq] : starts[seq] + n]
            v[row, :n] = value[starts[seq] : starts[seq] + n]
        positions = torch.arange(longest, device=query.device)
        causal = positions[None, :] <= positions[:, None]  # [q, k]
        in_sequence = positions[None, :] < torch.tensor(lengths, device=query.device)[:, None]
        mask = (causal[None] & in_sequence[:, None, :])[:, None]  # [S, 1, q, k]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=gqa,
    ).transpose(1, 2)  # [S, longest, Hq, D]
    if mask is None:
        out[first:last] = o.reshape(last - first, num_q_heads, head_dim)
    else:
        for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            out[starts[seq] : starts[seq] + n] = o[row, :n]
    return set(seqs)
