"""The tensors of one forward step over a ragged batch (no padding).

Token order in every [T, ...] tensor: all prefill tokens first (sequence by sequence), then one
token per decode sequence. A "decode" is any sequence scheduled for exactly one token whose
earlier tokens are in the KV cache; everything else takes the prefill path.

    input_ids  [ p0 p0 p0 p0 | p1 p1 | d0 | d1 | d2 ]
                 prefill seq0  seq1    decodes (one query each)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.worker.lora.batch import LoraBatch


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
    logits_indices: torch.Tensor | None
    """[R] int64 rows of the hidden states to turn into logits (the sampled positions);
    None = every row (a decode step samples every sequence)."""
    token_block_tables: torch.Tensor | None = None
    """[T, max_blocks] int32 block table of each token's sequence; with token_context_lens,
    set only in batch-invariant mode, where every token (prefill ones too) attends to the
    cache as a decode query does, so a token's attention never depends on how its prompt was
    chunked or what it was batched with."""
    token_context_lens: torch.Tensor | None = None
    """[T] int32 keys each token sees (its position + 1; its own K/V is written first)."""
    lora: LoraBatch | None = None
    """The rows' LoRA adapters (services/worker/lora/batch.py), set only when some row has
    one: each projection then adds its rows' deltas. None costs nothing."""

    @classmethod
    def for_decode(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> ForwardBatch:
        """A batch of decodes only (one token per sequence, every row sampled)."""
        no_prefill = torch.zeros(0, dtype=torch.int32, device=input_ids.device)
        return cls(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            num_prefill_tokens=0,
            prefill_cu_seqlens=no_prefill,
            prefill_prefix_lens=no_prefill,
            prefill_block_tables=block_tables[:0],
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            logits_indices=None,
        )
