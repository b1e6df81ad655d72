"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) over a ragged batch and a paged KV cache.

Projections are fused (q|k|v and gate|up) so a layer runs four matmuls. Every non-matmul op
goes through `kernels.ops`, which picks torch (CPU) or Triton (CUDA) in one place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from kernels import ops
from services.common.errors import ModelLoadError
from services.contracts.model_config import ModelConfig
from services.worker.forward_batch import ForwardBatch
from services.worker.kv_cache import LayerKVCache
from services.worker.model.rope import cos_sin_cache

# key, value (+ key_scale, value_scale for an int8 cache), each [num_blocks, block_size, ...]
KVCache = LayerKVCache


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self, hidden: Tensor, batch: ForwardBatch, kv_cache: KVCache, rope: Tensor
    ) -> Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Views into the fused projection output; rotary rotates them in place.
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
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
        return self.o_proj(out.reshape(num_tokens, self.q_size))

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
        )


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(hidden)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(
            torch.ones(config.hidden_size), requires_grad=False
        )
        self.self_attn = Attention(config)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: Tensor,
        residual: Tensor | None,
        batch: ForwardBatch,
        kv_cache: KVCache,
        rope: Tensor,
    ) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            hidden, residual = ops.fused_add_rms_norm(
                hidden, residual, self.input_layernorm, self.eps
            )
        hidden = self.self_attn(hidden, batch, kv_cache, rope)
        hidden, residual = ops.fused_add_rms_norm(
            hidden, residual, self.post_attention_layernorm, self.eps
        )
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, *, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.max_positions = max_positions or config.max_position_embeddings
        self.register_buffer("rope", self._rope_table(), persistent=False)
        self.requires_grad_(False)

    def tie_weights(self) -> None:
        """Share the embedding with the output projection (re-run after moving devices)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache]) -> Tensor:
        """Logits (fp32) for the rows in batch.logits_indices: [R, vocab]."""
        hidden = self.embed_tokens(batch.input_ids)
        residual: Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, batch, kv_cache, self.rope)
        assert residual is not None
        # Only the sampled rows need the final norm and the (large) vocabulary projection.
        rows = batch.logits_indices
        if rows is not None:
            hidden, residual = hidden[rows], residual[rows]
        return self.logits(hidden, residual)

    def logits(self, hidden: Tensor, residual: Tensor) -> Tensor:
        """The last layer's output (hidden + residual) -> fp32 logits [R, vocab]."""
        last = ops.rms_norm(hidden + residual, self.norm, self.config.rms_norm_eps)
        return self.lm_head(last).float()

    # --- weights -------------------------------------------------------------------------

    def load_hf_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load tensors named as in Hugging Face checkpoints, fusing q|k|v and gate|up."""
        pending: dict[str, dict[int, Tensor]] = {}
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if hf_name == "rope_freqs":
                self.rope.copy_(self._rope_table(rope_freqs=tensor))
                continue
            if "rotary_emb.inv_freq" in hf_name:
                continue
            key, part, num_parts = _parameter_name(hf_name)
            if key == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if num_parts == 1:
                self._assign(key, tensor)
                loaded.add(key)
                continue
            parts = pending.setdefault(key, {})
            parts[part] = tensor
            if len(parts) == num_parts:
                self._assign(key, torch.cat([parts[i] for i in range(num_parts)]))
                del pending[key]
                loaded.add(key)
        if pending:
            raise ModelLoadError(f"incomplete fused weights: {sorted(pending)}")
        missing = {name for name, _ in self.named_parameters()} - loaded
        if missing:
            raise ModelLoadError(f"weights missing from the checkpoint: {sorted(missing)[:8]}")

    def _rope_table(self, rope_freqs: Tensor | None = None) -> Tensor:
        config = self.config
        return cos_sin_cache(
            config.head_dim,
            self.max_positions,
            config.rope_theta,
            config.rope_scaling,
            rope_freqs=rope_freqs,
        )

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


# Hugging Face projection name -> (our fused parameter, index of the part, number of parts).
_FUSED_PROJECTIONS = {
    "q_proj": ("self_attn.qkv_proj", 0, 3),
    "k_proj": ("self_attn.qkv_proj", 1, 3),
    "v_proj": ("self_attn.qkv_proj", 2, 3),
    "gate_proj": ("mlp.gate_up_proj", 0, 2),
    "up_proj": ("mlp.gate_up_proj", 1, 2),
}


def _parameter_name(hf_name: str) -> tuple[str, int, int]:
    """'model.layers.3.self_attn.k_proj.weight' -> ('layers.3.self_attn.qkv_proj.weight', 1, 3)."""
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    if len(parts) == 5 and parts[0] == "layers" and parts[3] in _FUSED_PROJECTIONS:
        fused, index, count = _FUSED_PROJECTIONS[parts[3]]
        return f"layers.{parts[1]}.{fused}.{parts[4]}", index, count
    if name.endswith("layernorm.weight"):
        return name.removesuffix(".weight"), 0, 1
    if name == "norm.weight":
        return "norm", 0, 1
    return name, 0, 1
