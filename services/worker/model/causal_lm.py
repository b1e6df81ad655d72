"""The one decoder-only model of every family, over a ragged batch and a paged KV cache.

A family's differences are switches of `ModelArchitecture` (services/worker/model/
architecture.py): norms before and/or after each block, QK-norm, GELU or SiLU gating,
per-layer sliding windows and ropes, soft-capping, multipliers. Projections are fused
(q|k|v and gate|up) so a layer runs four matmuls. Every non-matmul op goes through
`kernels.ops`, which picks torch (CPU) or Triton (CUDA) in one place. A batch whose rows use
LoRA adapters (`batch.lora`, services/worker/lora/) hands each layer its share (`lora`), which
adds each row's delta to the output of each of the four.

One layer (the residual stream is carried beside the block outputs, so each add fuses with
the norm that follows it):

    x ─┬─ attn_norm? ─ attention ─ attn_out_norm? ─ × residual_multiplier ─(+)─┬─ mlp_norm? ...
       └──────────────────────────────────────────────────────────────────────┘
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn

from kernels import ops
from services.contracts.errors import ModelLoadError
from services.worker.forward_batch import ForwardBatch
from services.worker.kv_cache import LayerKVCache
from services.worker.model.architecture import ModelArchitecture
from services.worker.model.rope import cos_sin_cache

if TYPE_CHECKING:
    from services.worker.lora.batch import LoraLayer

# key, value (+ key_scale, value_scale for an int8 cache), each [num_blocks, block_size, ...]
KVCache = LayerKVCache


class WeightPart(NamedTuple):
    """A checkpoint tensor addressed to one of our parameters: the whole of it, or part
    `part` of `num_parts` stacked along dim 0 (q, k, v of qkv_proj; gate, up of gate_up)."""

    parameter: str
    part: int
    num_parts: int
    tensor: Tensor


def _norm_weight(size: int) -> nn.Parameter:
    return nn.Parameter(torch.ones(size), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchitecture, layer: int) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.query_scale
        self.eps = arch.rms_norm_eps
        self.sliding_window = arch.sliding_window(layer)
        self.logit_softcap = arch.attn_logit_softcap
        self.uses_rope = arch.uses_rope(layer)
        self.qk_norm = arch.qk_norm
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm: nn.Parameter | None = None
        self.k_norm: nn.Parameter | None = None
        if arch.qk_norm == "per_head":
            self.q_norm, self.k_norm = _norm_weight(self.head_dim), _norm_weight(self.head_dim)
        elif arch.qk_norm == "across_heads":
            self.q_norm, self.k_norm = _norm_weight(self.q_size), _norm_weight(self.kv_size)

    def forward(
        self,
        hidden: Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
        rope: Tensor,
        lora: LoraLayer | None = None,
    ) -> Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            lora.add("qkv", hidden, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "across_heads":
            assert self.q_norm is not None and self.k_norm is not None
            q = ops.rms_norm(q, self.q_norm, self.eps)
            k = ops.rms_norm(k, self.k_norm, self.eps)
        # Views into the fused projection output; rotary rotates them in place.
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            assert self.q_norm is not None and self.k_norm is not None
            q = ops.rms_norm(q, self.q_norm, self.eps)
            k = ops.rms_norm(k, self.k_norm, self.eps)
        if self.uses_rope:
            q, k = ops.apply_rotary(q, k, batch.positions, rope)
        ops.write_kv_cache(
            k,
            v,
            kv_cache.key,
            kv_cache.value,
            batch.slot_mapping,
            kv_cache.key_scale,
            kv_cache.value_scale,
        )

        num_prefill = batch.num_prefill_tokens
        if batch.token_context_lens is not None:
            out = self._per_token(q, batch, kv_cache)
        elif num_prefill == num_tokens:
            out = self._prefill(q, k, v, batch, kv_cache)
        elif num_prefill == 0:
            out = self._decode(q, batch, kv_cache)
        else:
            out = torch.cat(
                [
                    self._prefill(
                        q[:num_prefill], k[:num_prefill], v[:num_prefill], batch, kv_cache
                    ),
                    self._decode(q[num_prefill:], batch, kv_cache),
                ]
            )
        out = out.reshape(num_tokens, self.q_size)
        projected = self.o_proj(out)
        if lora is not None:
            lora.add("o", out, projected)
        return projected

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, batch: ForwardBatch, kv: KVCache) -> Tensor:
        return ops.prefill_attention(
            q,
            k,
            v,
            kv.key,
            kv.value,
            batch.prefill_cu_seqlens,
            batch.prefill_prefix_lens,
            batch.prefill_block_tables,
            self.scale,
            kv.key_scale,
            kv.value_scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )

    def _per_token(self, q: Tensor, batch: ForwardBatch, kv: KVCache) -> Tensor:
        """Every token as a decode query over the cache (batch-invariant mode)."""
        assert batch.token_block_tables is not None and batch.token_context_lens is not None
        return ops.paged_decode_attention(
            q,
            kv.key,
            kv.value,
            batch.token_block_tables,
            batch.token_context_lens,
            self.scale,
            kv.key_scale,
            kv.value_scale,
            batch_invariant=True,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )

    def _decode(self, q: Tensor, batch: ForwardBatch, kv: KVCache) -> Tensor:
        return ops.paged_decode_attention(
            q,
            kv.key,
            kv.value,
            batch.decode_block_tables,
            batch.decode_context_lens,
            self.scale,
            kv.key_scale,
            kv.value_scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )


class MLP(nn.Module):
    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.gelu_tanh = arch.hidden_act == "gelu_tanh"

    def forward(self, hidden: Tensor, lora: LoraLayer | None = None) -> Tensor:
        gate_up = self.gate_up_proj(hidden)
        if lora is not None:
            lora.add("gate_up", hidden, gate_up)
        gated = ops.gelu_tanh_and_mul(gate_up) if self.gelu_tanh else ops.silu_and_mul(gate_up)
        out = self.down_proj(gated)
        if lora is not None:
            lora.add("down", gated, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchitecture, layer: int) -> None:
        super().__init__()
        self.eps = arch.rms_norm_eps
        self.residual_multiplier = arch.residual_multiplier
        hidden = arch.hidden_size
        self.attn_norm = _norm_weight(hidden) if arch.pre_norms else None
        self.mlp_norm = _norm_weight(hidden) if arch.pre_norms else None
        self.attn_out_norm = _norm_weight(hidden) if arch.post_norms else None
        self.mlp_out_norm = _norm_weight(hidden) if arch.post_norms else None
        self.self_attn = Attention(arch, layer)
        self.mlp = MLP(arch)

    def forward(
        self,
        hidden: Tensor,
        residual: Tensor | None,
        batch: ForwardBatch,
        kv_cache: KVCache,
        rope: Tensor,
        lora: LoraLayer | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(block output, residual stream): the caller's next add is output + residual."""
        hidden, residual = self._add_norm(hidden, residual, self.attn_norm)
        hidden = self._block_output(
            self.self_attn(hidden, batch, kv_cache, rope, lora), self.attn_out_norm
        )
        hidden, residual = self._add_norm(hidden, residual, self.mlp_norm)
        return self._block_output(self.mlp(hidden, lora), self.mlp_out_norm), residual

    def _add_norm(
        self, hidden: Tensor, residual: Tensor | None, norm: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        if residual is not None:
            if norm is not None:
                return ops.fused_add_rms_norm(hidden, residual, norm, self.eps)
            hidden = hidden + residual
        if norm is None:
            return hidden, hidden
        return ops.rms_norm(hidden, norm, self.eps), hidden

    def _block_output(self, hidden: Tensor, norm: Tensor | None) -> Tensor:
        if norm is not None:
            hidden = ops.rms_norm(hidden, norm, self.eps)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden


class CausalLM(nn.Module):
    def __init__(self, arch: ModelArchitecture, *, max_positions: int | None = None) -> None:
        super().__init__()
        self.architecture = arch
        # Uninitialized: every weight is loaded. (Its random init, normal_, would also import
        # torch._dynamo on the meta device the loader builds on: 150 MB of the worker's RSS.)
        self.embed_tokens = nn.Embedding(
            arch.vocab_size,
            arch.hidden_size,
            _weight=torch.empty(arch.vocab_size, arch.hidden_size),
            _freeze=True,
        )
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size), requires_grad=False)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()
        self.max_positions = min(
            max_positions or arch.max_position_embeddings, arch.max_position_embeddings
        )
        self.register_buffer("rope", self.rope_table(local=False), persistent=False)
        # Sliding-window layers of some families (Gemma 3) have a rope of their own.
        self.register_buffer("local_rope", self.rope_table(local=True), persistent=False)
        self.requires_grad_(False)

    def tie_weights(self) -> None:
        """Share the embedding with the output projection (re-run after moving devices)."""
        if self.architecture.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def rope_table(self, *, local: bool) -> Tensor | None:
        arch = self.architecture
        if local and arch.local_rope is None:
            return None
        rope = arch.local_rope if local and arch.local_rope is not None else arch.rope
        # Computed on the host even while the model is built on `meta` (ops on meta tensors go
        # through torch's Python references, which import torch._dynamo: 150 MB of RSS).
        with torch.device("cpu"):
            return cos_sin_cache(rope, arch.head_dim, self.max_positions)

    def layer_rope(self, index: int) -> Tensor:
        if self.local_rope is not None and self.architecture.sliding_window(index):
            return self.local_rope
        return self.rope

    def embed(self, input_ids: Tensor) -> Tensor:
        hidden = self.embed_tokens(input_ids)
        multiplier = self.architecture.embedding_multiplier
        if multiplier != 1.0:
            # In the model dtype, as the reference implementations round it (Gemma).
            hidden = hidden * torch.tensor(multiplier, dtype=hidden.dtype)
        return hidden

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache]) -> Tensor:
        """Logits (fp32) for the rows in batch.logits_indices: [R, vocab]."""
        hidden = self.embed(batch.input_ids)
        residual: Tensor | None = None
        lora = batch.lora
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            rope = self.layer_rope(index)
            layer_lora = lora.layer(index) if lora is not None else None
            hidden, residual = layer(hidden, residual, batch, kv_cache, rope, layer_lora)
        assert residual is not None
        # Only the sampled rows need the final norm and the (large) vocabulary projection.
        rows = batch.logits_indices
        if rows is not None:
            hidden, residual = hidden[rows], residual[rows]
        return self.logits(hidden, residual)

    def logits(self, hidden: Tensor, residual: Tensor) -> Tensor:
        """The last layer's output (hidden + residual) -> fp32 logits [R, vocab]."""
        arch = self.architecture
        last = ops.rms_norm(hidden + residual, self.norm, arch.rms_norm_eps)
        logits = self.lm_head(last).float()
        if arch.logits_divisor != 1.0:
            logits = logits / arch.logits_divisor
        if arch.final_logit_softcap:
            cap = arch.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    # --- weights -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[WeightPart]) -> None:
        """Copy checkpoint tensors into the parameters, stacking fused parts."""
        pending: dict[str, dict[int, Tensor]] = {}
        loaded: set[str] = set()
        for name, part, num_parts, tensor in weights:
            if name == "lm_head.weight" and self.architecture.tie_word_embeddings:
                continue
            if num_parts == 1:
                self._assign(name, tensor)
                loaded.add(name)
                continue
            parts = pending.setdefault(name, {})
            parts[part] = tensor
            if len(parts) == num_parts:
                self._assign(name, torch.cat([parts[i] for i in range(num_parts)]))
                del pending[name]
                loaded.add(name)
        if pending:
            raise ModelLoadError(f"incomplete fused weights: {sorted(pending)}")
        missing = {name for name, _ in self.named_parameters()} - loaded
        if missing:
            raise ModelLoadError(f"weights missing from the checkpoint: {sorted(missing)[:8]}")

    def _assign(self, key: str, tensor: Tensor) -> None:
        try:
            param = self.get_parameter(key)
        except AttributeError as exc:
            raise ModelLoadError(f"unexpected weight {key!r}") from exc
        if param.shape != tensor.shape:
            raise ModelLoadError(
                f"weight {key!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
