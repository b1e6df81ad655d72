"""The tensors of one forward step over a ragged batch (no padding).

Token order in every [T, ...] tensor: all prefill tokens first (sequence by sequence), then one
token per decode sequence. A "decode" is any sequence scheduled for exactly one token whose
earlier tokens are in the KV cache; everything else takes the prefill path.

    input_ids  [ p0 p0 p0 p0 | p1 p1 | d0 | d1 | d2 ]
                 prefill seq0  seq1    decodes (one query each)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor
    """[T] int64 token ids."""
    positions: torch.Tensor
    """[T] int64 position of each token in its sequence."""
    slot_mapping: torch.Tensor
    """[T] int64 KV cache slot (block_id * block_size + offset) for each token."""
    num_prefill_tokens: int
    prefill_cu_seqlens: torch.Tensor
    """[S+1] int32 cumulative new-token counts of the S prefill sequences."""
    prefill_prefix_lens: torch.Tensor
    """[S] int32 tokens of each prefill sequence already in the cache."""
    prefill_block_tables: torch.Tensor
    """[S, max_blocks] int32."""
    decode_block_tables: torch.Tensor
    """[B, max_blocks] int32."""
    decode_context_lens: torch.Tensor
    """[B] int32 context length including the token being decoded."""
    logits_indices: torch.Tensor
    """[R] int64 rows of the hidden states to turn into logits (the sampled positions)."""
