"""The ops the model calls, one function each; `kernels.backend` picks torch or Triton.

Triton modules are imported lazily, inside the branch that needs them, so a CPU-only install
never imports triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels import (
    activation_torch,
    attention_torch,
    kv_cache_torch,
    norm_torch,
    quant_gemm_torch,
    quant_weight_only_torch,
    rotary_torch,
)
from kernels.backend import use_cpu_extension, use_triton
from kernels.kv_cache_torch import dequantize_kv_int8, quantize_kv_int8
from kernels.quant_gemm_torch import quantize_int8_rows

__all__ = [
    "apply_rotary",
    "apply_token_bitmask",
    "argmax_rows",
    "dequantize_kv_int8",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "int4_packed_gemm",
    "int8_gemm",
    "int8_weight_only_gemm",
    "nf4_gemm",
    "paged_decode_attention",
    "prefill_attention",
    "quantize_int8_rows",
    "quantize_kv_int8",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]


def argmax_rows(logits: Tensor) -> Tensor:
    """torch.argmax(logits, dim=-1) of [rows, vocab] logits, the same ids (greedy sampling):
    fp32 rows on a CPU take the C++ kernel (kernels/csrc/argmax_rows.cpp), several times
    faster there than torch's; anything else takes torch's."""
    if (
        logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(1) == 1
        and use_cpu_extension(logits)
    ):
        return torch.ops.llmserve.argmax_rows(logits)  # type: ignore[no-any-return]
    return logits.argmax(dim=-1)


def write_kv_cache(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Scatter key/value [T, Hkv, D] into the paged caches at slot_mapping [T]; in place."""
    if use_triton(key):
        from kernels import triton_kv_cache

        triton_kv_cache.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if use_cpu_extension(key):
        # In place, no quantized copy of the whole step; also skips slot -1 (padding tokens).
        # K and V in two calls: K and V caches are views of one storage, and in a compiled
        # graph one op mutating both makes functionalization copy a whole cache every call.
        torch.ops.llmserve.write_cache(key, k_cache, slot_mapping, k_scale)
        torch.ops.llmserve.write_cache(value, v_cache, slot_mapping, v_scale)
        return
    kv_cache_torch.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def apply_token_bitmask(
    logits: Tensor, bitmask: Tensor, rows: Sequence[int], vocab_size: int
) -> bool:
    """Set to -inf, in place, the logits of the tokens each listed row's bitmask disallows
    (int32 words, bit j of word w = token 32w + j; tokens >= vocab_size left alone). False:
    no kernel here for these tensors (not a float32 CPU tensor, or no C++ build), and the
    caller applies the mask its own way."""
    if logits.dtype != torch.float32 or not use_cpu_extension(logits):
        return False
    indices = torch.tensor(list(rows), dtype=torch.int64)
    torch.ops.llmserve.apply_token_bitmask(logits, bitmask, indices, vocab_size)
    return True


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    batch_invariant: bool = False,
    *,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> Tensor:
    """query [B, Hq, D], one token per sequence, over its paged KV -> [B, Hq, D].

    batch_invariant: each row's output depends only on its own query and context (no split
    of a context whose place depends on the rest of the batch); CPU only.
    sliding_window W > 0: only the last W tokens of each context (0: all of them);
    logit_softcap c > 0: scores become c * tanh(scores / c) before the softmax (0: off)."""
    args = (query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    if use_triton(query):
        if batch_invariant:
            raise NotImplementedError("batch-invariant decode attention is CPU-only")
        from kernels import triton_decode_attention

        return triton_decode_attention.paged_decode_attention(
            *args, sliding_window=sliding_window, logit_softcap=logit_softcap
        )
    # The C++ kernel reads K/V in place (the torch path gathers a dense copy first) and is
    # faster in every cell of benchmarks/kernels_decode_cpu.py: bf16, bf16 + int8 KV, fp32.
    if use_cpu_extension(query):
        return torch.ops.llmserve.paged_decode_attention(  # type: ignore[no-any-return]
            *args, batch_invariant, sliding_window, logit_softcap
        )
    return attention_torch.paged_decode_attention(
        *args,
        batch_invariant=batch_invariant,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )


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
    """Packed varlen causal prefill over cached prefix + new tokens -> [T, Hq, D].

    sliding_window W > 0: the token at position p sees keys p - W < j <= p; logit_softcap
    c > 0: scores become c * tanh(scores / c) (0: off for both)."""
    if use_triton(query):
        from kernels import triton_prefill_attention

        return triton_prefill_attention.prefill_attention(
            query,
            key,
            value,
            k_cache,
            v_cache,
            cu_seqlens_q,
            prefix_lens,
            block_tables,
            scale,
            k_scale,
            v_scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
    return attention_torch.prefill_attention(
        query,
        key,
        value,
        k_cache,
        v_cache,
        cu_seqlens_q,
        prefix_lens,
        block_tables,
        scale,
        k_scale,
        v_scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, fp32 math, output in x.dtype."""
    if use_triton(x):
        from kernels import triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    return norm_torch.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    if use_triton(x):
        from kernels import triton_norm

        return triton_norm.fused_add_rms_norm(x, residual, weight, eps)
    return norm_torch.fused_add_rms_norm(x, residual, weight, eps)


def apply_rotary(
    query: Tensor, key: Tensor, positions: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    """NeoX-style rotary on query [T, Hq, D] and key [T, Hkv, D], in place; returns (q, k).

    cos_sin_cache [max_pos, R]: R = D rotates the whole head, R < D the first R dims only."""
    if use_triton(query):
        from kernels import triton_rotary

        return triton_rotary.apply_rotary(query, key, positions, cos_sin_cache)
    return rotary_torch.apply_rotary(query, key, positions, cos_sin_cache)


def silu_and_mul(x: Tensor) -> Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    if use_triton(x):
        from kernels import triton_activation

        return triton_activation.silu_and_mul(x)
    return activation_torch.silu_and_mul(x)


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """x [T, 2I] = [gate | up] -> gelu_tanh(gate) * up, [T, I] (GeGLU)."""
    if use_triton(x):
        from kernels import triton_activation

        return triton_activation.gelu_tanh_and_mul(x)
    return activation_torch.gelu_tanh_and_mul(x)


def int8_gemm(x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """W8A8 linear: x [M, K] (quantized per token here) @ w_q [N, K]^T int8 -> [M, N]."""
    if use_triton(x):
        from kernels import triton_quant_gemm

        return triton_quant_gemm.int8_gemm(x, w_q, w_scale, bias)
    return quant_gemm_torch.int8_gemm(x, w_q, w_scale, bias)


# Weight-only formats served by torch's CPU packed kernels (no Triton kernel: on CUDA the same
# functions dequantize and call a matmul, which is correct but not fast).


def int8_weight_only_gemm(x: Tensor, w_q: Tensor, w_scale: Tensor) -> Tensor:
    """x [M, K] @ (w_q [N, K] int8 · w_scale [N])^T -> [M, N]; activations stay float."""
    return quant_weight_only_torch.int8_weight_only_gemm(x, w_q, w_scale)


def int4_packed_gemm(
    x: Tensor, packed: Tensor, scales_and_zeros: Tensor, group_size: int, codes: Tensor | None
) -> Tensor:
    """Weight-only int4 in torch's CPU packed layout -> [M, N]."""
    return quant_weight_only_torch.int4_packed_gemm(x, packed, scales_and_zeros, group_size, codes)


def nf4_gemm(x: Tensor, packed: Tensor, absmax: Tensor) -> Tensor:
    """Weight-only NF4 (grouped absmax) -> [M, N]."""
    return quant_weight_only_torch.nf4_gemm(x, packed, absmax)


# GGUF weights kept as the file's blocks: the C++ kernels on CPU
# (kernels/csrc/gguf_gemm.cpp), dequantize + matmul elsewhere. Imported here, below the
# functions above, so this section stays self-contained.
from kernels import batch_invariant_torch, gguf_blocks_torch  # noqa: E402

__all__ += ["gguf_embedding", "gguf_kernel_layout", "gguf_linear", "gguf_linear_parts"]


def gguf_kernel_layout(blocks: Tensor, kind: int, in_place: bool = False) -> tuple[Tensor, int]:
    """The blocks in the layout the int8-activation kernels stream best, and its kind: Q4_0,
    Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K, Q5_K or Q6_K with a multiple of 8 rows regrouped by 8 rows
    (the same bytes) when the C++ kernels run here; anything else as it is. `in_place`:
    regroup inside `blocks` (a buffer the caller owns), with no second copy of the weight."""
    repackable = kind in gguf_blocks_torch.REPACKABLE_KINDS and blocks.shape[0] % 8 == 0
    if not repackable or not use_cpu_extension(blocks):
        return blocks, kind
    if in_place:
        repacked = torch.ops.llmserve.gguf_repack_(blocks.contiguous(), kind)
    else:
        repacked = torch.ops.llmserve.gguf_repack(blocks, kind)
    return repacked, kind | gguf_blocks_torch.GGUF_REPACKED_X8


def gguf_linear(
    x: Tensor,
    blocks: Tensor,
    kind: int,
    int8_activations: bool = False,
    batch_invariant: bool = False,
) -> Tensor:
    """x [M, K] @ W^T, W = GGUF blocks uint8 [N, K / values * bytes] of a ggml kind in
    gguf_blocks_torch.GGUF_KINDS -> [M, N] in x.dtype. fp32: exact weights, fp32 sums.
    bf16/fp16 on CPU, or any dtype with `int8_activations`: activations rounded to int8 per
    32 values, integer block dot products.

    batch_invariant: one arithmetic path at every M, so each output row depends only on its
    own input row (the fast path otherwise switches to fp32 panels from 16 rows on)."""
    if use_cpu_extension(x):
        return torch.ops.llmserve.gguf_linear(  # type: ignore[no-any-return]
            x.contiguous(), blocks, kind, int8_activations, batch_invariant
        )
    if int8_activations and (
        kind not in (gguf_blocks_torch.GGUF_Q4_0, gguf_blocks_torch.GGUF_Q4_1)
        or batch_invariant
        or x.shape[0] < gguf_blocks_torch.HALF_PANEL_MIN_ROWS
    ):
        # The rows the C++ kernels round too (Q4 layers of many rows compute exactly there).
        block = gguf_blocks_torch.activation_block(kind)
        x = gguf_blocks_torch.quantize_activation_blocks(x, block).to(x.dtype)
    if batch_invariant:
        return batch_invariant_torch.row_tiled(
            lambda tile: gguf_blocks_torch.gguf_linear(tile, blocks, kind), x
        )
    return gguf_blocks_torch.gguf_linear(x, blocks, kind)


def gguf_linear_parts(
    x: Tensor,
    parts: list[Tensor],
    kinds: list[int],
    int8_activations: bool = False,
    batch_invariant: bool = False,
) -> Tensor:
    """`gguf_linear` of each part, side by side -> [M, sum of the parts' N]: a fused layer
    whose parts the file stores in different kinds (q|k|v of a Q4_K_M file, say). The C++ op
    rounds the activations once for all parts."""
    if use_cpu_extension(x):
        return torch.ops.llmserve.gguf_linear_parts(  # type: ignore[no-any-return]
            x.contiguous(), parts, kinds, int8_activations, batch_invariant
        )
    outputs = [
        gguf_linear(x, part, kind, int8_activations, batch_invariant)
        for part, kind in zip(parts, kinds, strict=True)
    ]
    return torch.cat(outputs, dim=-1)


def gguf_embedding(token_ids: Tensor, blocks: Tensor, kind: int, dtype: torch.dtype) -> Tensor:
    """Rows token_ids of a GGUF-block table, dequantized exactly, in dtype -> [*ids, K]."""
    if use_cpu_extension(blocks):
        return torch.ops.llmserve.gguf_embedding(token_ids, blocks, kind, dtype)  # type: ignore[no-any-return]
    return gguf_blocks_torch.gguf_embedding(token_ids, blocks, kind, dtype)


# Batched multi-LoRA (kernels/lora_torch.py has the layout): segments of tokens, each with its
# adapter's slot (-1: none); Triton on CUDA, the C++ ops on CPU, the torch reference otherwise.
from kernels import lora_torch  # noqa: E402

__all__ += ["LoraShapeError", "lora_apply", "lora_expand", "lora_shrink"]
LoraShapeError = lora_torch.LoraShapeError


def lora_shrink(
    x: Tensor, lora_a: Tensor, seg_starts: Tensor, seg_slots: Tensor, out: Tensor
) -> None:
    """out[t] = x[t] @ lora_a[slot(t)].T, fp32 (num_tokens, S * R); rows of slot -1 unwritten.
    Raises LoraShapeError naming the argument whose shape, dtype or layout is wrong."""
    lora_torch.check_shrink(x, lora_a, seg_starts, seg_slots, out)
    if use_triton(x):
        from kernels import triton_lora

        triton_lora.lora_shrink(x, lora_a, seg_starts, seg_slots, out)
        return
    if use_cpu_extension(x):
        torch.ops.llmserve.lora_shrink(x, lora_a, seg_starts, seg_slots, out)
        return
    lora_torch.lora_shrink(x, lora_a, seg_starts, seg_slots, out)


def lora_expand(
    v: Tensor,
    lora_b: Tensor,
    seg_starts: Tensor,
    seg_slots: Tensor,
    scales: Tensor,
    y: Tensor,
    out_slices: Sequence[int] | None = None,
) -> None:
    """y[t] += scales[slot] * v[t] @ lora_b[slot].T in place (per output slice of a fused
    projection when out_slices is given); rows of slot -1 untouched."""
    lora_torch.check_expand(v, lora_b, seg_starts, seg_slots, scales, y, out_slices)
    if use_triton(y):
        from kernels import triton_lora

        triton_lora.lora_expand(v, lora_b, seg_starts, seg_slots, scales, y, out_slices)
        return
    if use_cpu_extension(y):
        torch.ops.llmserve.lora_expand(
            v, lora_b, seg_starts, seg_slots, scales, y, list(out_slices or [])
        )
        return
    lora_torch.lora_expand(v, lora_b, seg_starts, seg_slots, scales, y, out_slices)


def lora_apply(
    x: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    seg_starts: Tensor,
    seg_slots: Tensor,
    scales: Tensor,
    y: Tensor,
    out_slices: Sequence[int] | None = None,
) -> None:
    """Shrink then expand: y[t] += scales[slot] * (x[t] @ lora_a[slot].T) @ lora_b[slot].T in
    place. One C++ op on CPU (slot groups built once, the intermediate never leaves it)."""
    lora_torch.check_apply(x, lora_a, lora_b, seg_starts, seg_slots, scales, y, out_slices)
    if use_triton(x):
        from kernels import triton_lora

        v = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
        triton_lora.lora_shrink(x, lora_a, seg_starts, seg_slots, v)
        triton_lora.lora_expand(v, lora_b, seg_starts, seg_slots, scales, y, out_slices)
        return
    if use_cpu_extension(x):
        torch.ops.llmserve.lora_apply(
            x, lora_a, lora_b, seg_starts, seg_slots, scales, y, list(out_slices or [])
        )
        return
    lora_torch.lora_apply(x, lora_a, lora_b, seg_starts, seg_slots, scales, y, out_slices)
