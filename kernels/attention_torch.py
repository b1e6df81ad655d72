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

Sliding window (Mistral, Gemma 2/3, Qwen2): a query at position p sees keys p - W < j <= p,
W = sliding_window (0: no window). Blocks holding only keys before every row's window are not
gathered, so a long context costs the window. Soft-capped logits (Gemma 2, logit_softcap
c > 0: scores become c * tanh(scores / c) before the mask) have no SDPA form and take an
explicit fp32 softmax.
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


def _attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: float,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    enable_gqa: bool = False,
    logit_softcap: float = 0.0,
) -> Tensor:
    """SDPA over [..., H, n, D] (mask True = attend); soft-capped scores in explicit fp32."""
    if logit_softcap <= 0:
        # CPU SDPA takes its flash kernel for 4-D inputs only; [H, n, D] would go to the math
        # path, which materialises every score (measured, 2 cores, 9 query and 3 KV heads,
        # 1024 causal tokens, fp32: 90 ms math vs 18.5 ms flash per layer).
        batched = query.dim() == 3
        out = F.scaled_dot_product_attention(
            query[None] if batched else query,
            key[None] if batched else key,
            value[None] if batched else value,
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out[0] if batched else out
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=query.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ value.float()).to(query.dtype)


def _causal_mask(q_pos: Tensor, k_pos: Tensor, sliding_window: int) -> Tensor:
    """[nq, nk] True where the query at q_pos sees the key at k_pos (causal, windowed)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window > 0:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


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
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> Tensor:
    """One query token per sequence attending to its paged context.

    query [B, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D] (int8 with k_scale/
    v_scale [num_blocks, block_size, Hkv, D // group]); block_tables [B, max_blocks] int32;
    context_lens [B] int32 >= 1 (the current token's K/V is already in the cache).
    Returns [B, Hq, D] in query's dtype. batch_invariant: one call per sequence, cut to its
    own length, so no row's arithmetic depends on the others' lengths. sliding_window W > 0:
    only the last W tokens of each context; logit_softcap c > 0: scores c * tanh(scores / c).
    Block-table entries before a row's window are not read.
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
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
            for b in range(query.shape[0])
        ]
        return torch.cat(rows)
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} % Hkv {num_kv_heads} != 0"
    assert block_tables.shape[0] == batch and context_lens.shape == (batch,)
    assert sliding_window >= 0, f"sliding_window {sliding_window} < 0"
    group = num_q_heads // num_kv_heads
    # Only gather as many blocks as the longest context needs (one host sync; fine on CPU),
    # from the first block any row's window reaches (a second sync, only with a window).
    longest = int(context_lens.max())
    num_blocks = (longest + block_size - 1) // block_size
    window_starts: Tensor | None = None
    first_block = 0
    if sliding_window > 0:
        window_starts = (context_lens - sliding_window).clamp(min=0)
        first_block = int(window_starts.min()) // block_size
    block_ids = block_tables[:, first_block:num_blocks].long()
    if window_starts is not None and batch > 1:
        # Entries before a row's own window may name freed blocks: read block 0 there.
        columns = first_block + torch.arange(block_ids.shape[1], device=block_ids.device)
        before_window = columns[None, :] < (window_starts // block_size)[:, None]
        block_ids = block_ids.masked_fill(before_window, 0)
    keys = _gather_blocks(k_cache, k_scale, block_ids, query.dtype)  # [B, L, Hkv, D]
    values = _gather_blocks(v_cache, v_scale, block_ids, query.dtype)
    first_position = first_block * block_size  # the position of keys[:, 0]
    valid: Tensor | None = None
    if batch == 1 or bool((context_lens == longest).all()):
        # One length for all (always at batch 1): cut the keys to it and skip the mask;
        # SDPA's unmasked CPU path is ~1.6x faster on short contexts.
        start = max(longest - sliding_window, 0) if sliding_window > 0 else 0
        keys = keys[:, start - first_position : longest - first_position]
        values = values[:, start - first_position : longest - first_position]
    else:
        positions = first_position + torch.arange(keys.shape[1], device=query.device)
        valid = positions[None, :] < context_lens.to(positions.dtype)[:, None]
        if window_starts is not None:
            valid &= positions[None, :] >= window_starts.to(positions.dtype)[:, None]
        valid = valid[:, None, None, :]
    out = _attention(
        query.view(batch, num_kv_heads, group, head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        scale,
        valid,
        logit_softcap=logit_softcap,
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
    *,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> Tensor:
    """Causal attention for S packed sequences' new tokens over (cached prefix + new tokens).

    query [T, Hq, D]; key/value [T, Hkv, D] (this chunk's tokens, not read back from the
    cache); cu_seqlens_q [S+1] int32; prefix_lens [S] int32 tokens already cached, read via
    block_tables [S, max_blocks]. New token i of a sequence sits at position p = prefix_len + i
    and sees keys 0 ..= p, or p - W < j <= p with sliding_window W > 0 (cached blocks before
    the first new token's window are not read). logit_softcap c > 0: scores c * tanh(s / c).
    Returns [T, Hq, D].
    """
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert key.shape == (num_tokens, num_kv_heads, head_dim), f"key {tuple(key.shape)}"
    assert value.shape == key.shape, f"value {tuple(value.shape)}"
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} % Hkv {num_kv_heads} != 0"
    assert sliding_window >= 0, f"sliding_window {sliding_window} < 0"
    gqa = num_q_heads != num_kv_heads
    if k_cache.is_floating_point() and k_cache.dtype != key.dtype:
        # This chunk's keys and values as the cache holds them (a float16 cache under a float32
        # model): a later step reading them back from the cache, as a prefix hit or a decode
        # does, then sees the same values, so a prompt gives the same tokens cached or not.
        key = key.to(k_cache.dtype).to(key.dtype)
        value = value.to(v_cache.dtype).to(value.dtype)
    starts = cu_seqlens_q.tolist()
    prefixes = prefix_lens.tolist()
    assert len(starts) == len(prefixes) + 1 and starts[-1] == num_tokens
    out = torch.empty_like(query)
    fresh = [s for s, p in enumerate(prefixes) if p == 0 and starts[s + 1] > starts[s]]
    batched = _fresh_prefills_batched(
        query, key, value, starts, fresh, scale, gqa, out, sliding_window, logit_softcap
    )
    for seq, prefix_len in enumerate(prefixes):
        start, end = starts[seq], starts[seq + 1]
        if end == start or seq in batched:
            continue
        q = query[start:end].transpose(0, 1)  # [Hq, n, D]
        k = key[start:end]
        v = value[start:end]
        if prefix_len == 0 and sliding_window == 0:
            o = _attention(
                q,
                k.transpose(0, 1),
                v.transpose(0, 1),
                scale,
                is_causal=True,
                enable_gqa=gqa,
                logit_softcap=logit_softcap,
            )
        else:
            # The first key any new token sees: 0, or the first new token's window start.
            first_key = max(prefix_len - sliding_window + 1, 0) if sliding_window > 0 else 0
            if first_key < prefix_len:
                first_block = first_key // block_size
                num_blocks = (prefix_len + block_size - 1) // block_size
                block_ids = block_tables[seq, first_block:num_blocks].long()
                cached = slice(
                    first_key - first_block * block_size, prefix_len - first_block * block_size
                )
                k = torch.cat([_gather_blocks(k_cache, k_scale, block_ids, k.dtype)[cached], k])
                v = torch.cat([_gather_blocks(v_cache, v_scale, block_ids, v.dtype)[cached], v])
            else:
                first_key = prefix_len
            # SDPA's is_causal aligns the diagonal top-left; with a prefix it must be
            # bottom-right, so the mask is explicit.
            q_pos = torch.arange(prefix_len, prefix_len + end - start, device=query.device)
            k_pos = torch.arange(first_key, prefix_len + end - start, device=query.device)
            o = _attention(
                q,
                k.transpose(0, 1),
                v.transpose(0, 1),
                scale,
                _causal_mask(q_pos, k_pos, sliding_window),
                enable_gqa=gqa,
                logit_softcap=logit_softcap,
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
    sliding_window: int,
    logit_softcap: float,
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
    positions = torch.arange(longest, device=query.device)
    mask: Tensor | None = None
    if same_length and contiguous:
        # Packed back to back with one length: the batch is a view, no copies.
        q = query[first:last].view(count, longest, num_q_heads, head_dim)
        k = key[first:last].view(count, longest, num_kv_heads, head_dim)
        v = value[first:last].view(count, longest, num_kv_heads, head_dim)
        if sliding_window > 0:
            mask = _causal_mask(positions, positions, sliding_window)
    else:
        q = query.new_zeros(count, longest, num_q_heads, head_dim)
        k = key.new_zeros(count, longest, num_kv_heads, head_dim)
        v = value.new_zeros(count, longest, num_kv_heads, head_dim)
        for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            q[row, :n] = query[starts[seq] : starts[seq] + n]
            k[row, :n] = key[starts[seq] : starts[seq] + n]
            v[row, :n] = value[starts[seq] : starts[seq] + n]
        causal = _causal_mask(positions, positions, sliding_window)  # [q, k]
        in_sequence = positions[None, :] < torch.tensor(lengths, device=query.device)[:, None]
        mask = (causal[None] & in_sequence[:, None, :])[:, None]  # [S, 1, q, k]
    o = _attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        scale,
        mask,
        is_causal=mask is None,
        enable_gqa=gqa,
        logit_softcap=logit_softcap,
    ).transpose(1, 2)  # [S, longest, Hq, D]
    if same_length and contiguous:
        out[first:last] = o.reshape(last - first, num_q_heads, head_dim)
    else:
        for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            out[starts[seq] : starts[seq] + n] = o[row, :n]
    return set(seqs)
