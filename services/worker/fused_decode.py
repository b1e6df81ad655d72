"""Fused decode steps: a pure-decode batch of a model of any family (every switch of
`ModelArchitecture`: pre- and post-norms, QK-norm per head or across heads, SiLU or GELU
gating, soft-capped attention, per-layer windows and rope tables, layers without rope, a
residual multiplier) whose projections are all GGUF blocks (any kind the kernels read, kinds
mixed within a fused layer too) or dense float weights (a safetensors model in float32, bf16
or fp16) runs every decoder layer in one C++ call (kernels/csrc/llama_decode.cpp, the op
`llmserve::llama_decode_layers`); the embedding (with its multiplier), the final norm and the
vocabulary projection (with its divisor and soft-cap) stay in the model's own code.

Why: on a CPU at small batches the time between the matrix products (Python, dispatch, a
compiled graph's wrapper) was as large as the products. The fused call has no per-op cost and
needs no compilation, so it takes any batch size, and a dense model needs no step graphs
either (compiling them took 1 min 45 s of a first start on an AVX-512 machine). It computes what
`CausalLM.forward` computes for one token per sequence (fp32, the same kernels); the
tests hold its greedy tokens to the eager path's. A batch with LoRA rows passes the adapter
slots' tables and its segment table along, and the op adds each row's delta after each of the
four projections with the kernel the eager layers call (kernels/csrc/lora.cpp).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kernels import cpu_extension, gguf_blocks_torch
from services.worker.forward_batch import ForwardBatch
from services.worker.kv_cache import PagedKVCache
from services.worker.lora.adapter import PROJECTIONS
from services.worker.lora.batch import LoraBatch
from services.worker.model.causal_lm import CausalLM
from services.worker.quantization.gguf_linear import GGUFLinear

log = logging.getLogger(__name__)


def unsupported_reason(model: CausalLM, kv_cache: PagedKVCache) -> str | None:
    """Why the fused step cannot run this model (None: it can)."""
    if kv_cache.storage.device.type != "cpu":
        return "the KV cache is not on the CPU"
    if model.norm.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the model computes in {model.norm.dtype}"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not isinstance(linear, GGUFLinear) and not _is_dense(linear):
                return (
                    f"a projection is {type(linear).__name__}, neither GGUF blocks nor a "
                    "dense float weight"
                )
        if any(linear.bias is not None for linear in (attn.o_proj, mlp.gate_up_proj)):
            return "o_proj or gate_up_proj has a bias"
        if mlp.down_proj.bias is not None:
            return "down_proj has a bias"
    if not cpu_extension.load():
        return "the C++ CPU kernels are unavailable"
    return None


# ggml's type ids of unquantized tensors: how the op names a dense projection's weight.
DENSE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}


def _is_dense(linear: nn.Module) -> bool:
    return type(linear) is nn.Linear and linear.weight.dtype in DENSE_KINDS


def projection_parts(linear: nn.Module) -> tuple[list[Tensor], list[int]]:
    """The op's parts and kinds of one projection: a GGUF layer's block tensors, or an
    nn.Linear's weight as one dense part."""
    if isinstance(linear, GGUFLinear):
        return list(linear.parts), list(linear.kinds)
    return [linear.weight], [DENSE_KINDS[linear.weight.dtype]]


def _fp32(tensor: Tensor) -> Tensor:
    """The tensor itself when it is fp32 already (no copy), else an fp32 copy."""
    return tensor.float().contiguous()


@dataclass(frozen=True, slots=True)
class _LayerLists:
    """The op's per-layer arguments, gathered once (the tensors are the model's own)."""

    attn_norms: list[Tensor]
    """One fp32 weight per layer of each norm the model has; empty: no such norm (OLMo 2 has
    no attn_norm / mlp_norm, Llama no *_out_norm)."""
    mlp_norms: list[Tensor]
    attn_out_norms: list[Tensor]
    mlp_out_norms: list[Tensor]
    projection_parts: list[Tensor]
    """Every layer's q|k|v, o, gate|up and down block tensors, in that order."""
    kinds: list[int]
    """One per part."""
    part_counts: list[int]
    """Parts per projection, 4 per layer."""
    qkv_bias: list[Tensor]
    q_norms: list[Tensor]
    """RMSNorm weights of q and k, one per layer: [head_dim] per head (Qwen3, Gemma 3) or
    [heads * head_dim] across heads (OLMo 2); empty: none."""
    k_norms: list[Tensor]
    k_caches: list[Tensor]
    v_caches: list[Tensor]
    k_scales: list[Tensor]
    v_scales: list[Tensor]
    ropes: list[Tensor]
    """The model's rotary tables in fp32: the global one, then the windowed layers' own
    (Gemma 3) when it has one."""
    layer_ropes: list[int]
    """Per layer, its table's index in `ropes`, as `CausalLM.layer_rope` picks it; -1: the
    layer has no rotary (SmolLM3's NoPE layers)."""


def _layer_norms(norms: list[Tensor | None]) -> list[Tensor]:
    """fp32 copies of one norm of every layer; empty when the model has no such norm."""
    return [_fp32(norm) for norm in norms if norm is not None]


def _rope_lists(model: CausalLM) -> tuple[list[Tensor], list[int]]:
    """(ropes, layer_ropes): the model's tables and each layer's choice among them."""
    tables = [model.rope] if model.local_rope is None else [model.rope, model.local_rope]
    arch = model.architecture
    layer_ropes = [
        next(index for index, table in enumerate(tables) if table is model.layer_rope(layer))
        if arch.uses_rope(layer)
        else -1
        for layer in range(arch.num_layers)
    ]
    return [table.float().contiguous() for table in tables], layer_ropes


class FusedDecode:
    """Runs pure-decode batches, and in the batch-invariant mode every batch without LoRA
    rows, through `llmserve::llama_decode_layers`."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache) -> None:
        reason = unsupported_reason(model, kv_cache)
        if reason is not None:
            raise ValueError(f"fused decode steps cannot run this model: {reason}")
        self.model = model
        arch = model.architecture
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.eps = arch.rms_norm_eps
        self.scale = arch.query_scale
        # One window per layer (0: full attention).
        self.sliding_windows = [arch.sliding_window(i) for i in range(arch.num_layers)]
        projections = [
            (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            for layer in model.layers
        ]
        first_qkv = projections[0][0]
        self.int8_activations = getattr(first_qkv, "int8_activations", False)
        caches = kv_cache.layers
        linears = [linear for layer in projections for linear in layer]
        self.dtype = model.norm.dtype
        """The model's dtype: the step computes in fp32 between its embedding and its head
        (fp32 copies of a bf16 model's norms, bias and rope tables, a few KB)."""
        self.query_in_cache_dtype = kv_cache.spec.dtype == self.dtype != torch.float32
        """Whether attention reads the cache with a query rounded to the cache's dtype, as a
        bf16/fp16 model's eager layers do; a float32 model's query stays float32 over a float16
        cache."""
        self.attn_logit_softcap = arch.attn_logit_softcap
        self.residual_multiplier = arch.residual_multiplier
        self.hidden_act = arch.hidden_act
        projection_lists = [projection_parts(linear) for linear in linears]
        layers = list(model.layers)
        ropes, layer_ropes = _rope_lists(model)
        self._lists = _LayerLists(
            attn_norms=_layer_norms([layer.attn_norm for layer in layers]),
            mlp_norms=_layer_norms([layer.mlp_norm for layer in layers]),
            attn_out_norms=_layer_norms([layer.attn_out_norm for layer in layers]),
            mlp_out_norms=_layer_norms([layer.mlp_out_norm for layer in layers]),
            projection_parts=[part for parts, _ in projection_lists for part in parts],
            kinds=[kind for _, kinds in projection_lists for kind in kinds],
            part_counts=[len(kinds) for _, kinds in projection_lists],
            qkv_bias=[_fp32(p[0].bias) for p in projections if p[0].bias is not None],
            q_norms=_layer_norms([layer.self_attn.q_norm for layer in layers]),
            k_norms=_layer_norms([layer.self_attn.k_norm for layer in layers]),
            k_caches=[c.key for c in caches],
            v_caches=[c.value for c in caches],
            k_scales=[c.key_scale for c in caches if c.key_scale is not None],
            v_scales=[c.value_scale for c in caches if c.value_scale is not None],
            ropes=ropes,
            layer_ropes=layer_ropes,
        )
        self.num_steps = 0
        """Steps run fused (for tests and the step profile)."""

    @classmethod
    def for_model(cls, model: CausalLM, kv_cache: PagedKVCache) -> FusedDecode | None:
        """The fused step for this model, or None (and one log line saying why)."""
        reason = unsupported_reason(model, kv_cache)
        if reason is not None:
            log.info("decode steps not fused", extra={"reason": reason})
            return None
        return cls(model, kv_cache)

    def is_batch_invariant(self) -> bool:
        """Whether a token's result never depends on the rows beside it: every projection is
        GGUF blocks read with int8 activations by a kernel whose arithmetic is the same at
        every M (kernels/csrc/gguf_gemm.cpp: every kind but Q4_0 / Q4_1 in the file's layout,
        which switches to fp32 panels from 16 rows); the rest of the op works row by row, and
        its attention never splits a context by the batch."""
        file_layout_q4 = (gguf_blocks_torch.GGUF_Q4_0, gguf_blocks_torch.GGUF_Q4_1)
        return self.int8_activations and all(
            kind not in DENSE_KINDS.values() and kind not in file_layout_q4
            for kind in self._lists.kinds
        )

    @staticmethod
    def can_run(batch: ForwardBatch) -> bool:
        """Pure-decode batches; and any batch whose tokens each carry their sequence's block
        table (per-token attention, the batch-invariant mode): a prefill token then attends
        as a decode query over the paged cache, after the step has written the keys and values
        of every token before it. With or without LoRA rows: the segment table covers every
        token, and a row's delta is the same whatever segment it sits in."""
        if batch.input_ids.shape[0] == 0:
            return False
        if batch.num_prefill_tokens == 0:
            return True
        return batch.token_block_tables is not None

    def run(self, batch: ForwardBatch, with_logits: bool = True) -> Tensor | None:
        """Logits (fp32) of the batch's sampled rows: [B, vocab] for a pure-decode batch,
        the rows of batch.logits_indices for one holding prefill tokens; None without
        `with_logits` (a step that only fills the cache)."""
        model = self.model
        hidden = model.embed(batch.input_ids).float()
        hidden, residual = torch.ops.llmserve.llama_decode_layers(*self.op_arguments(hidden, batch))
        self.num_steps += 1
        if not with_logits:
            return None
        if batch.num_prefill_tokens and batch.logits_indices is not None:
            hidden, residual = hidden[batch.logits_indices], residual[batch.logits_indices]
        return model.logits(hidden.to(self.dtype), residual.to(self.dtype))

    def op_arguments(self, hidden: Tensor, batch: ForwardBatch) -> tuple[object, ...]:
        """`llmserve::llama_decode_layers`'s arguments for this batch, in schema order."""
        lists = self._lists
        return (
            hidden,
            lists.attn_norms,
            lists.mlp_norms,
            lists.attn_out_norms,
            lists.mlp_out_norms,
            lists.projection_parts,
            lists.kinds,
            lists.part_counts,
            lists.qkv_bias,
            lists.q_norms,
            lists.k_norms,
            lists.k_caches,
            lists.v_caches,
            lists.k_scales,
            lists.v_scales,
            batch.positions,
            batch.slot_mapping,
            *_attention_tables(batch),
            lists.ropes,
            lists.layer_ropes,
            self.sliding_windows,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
            self.attn_logit_softcap,
            self.residual_multiplier,
            self.hidden_act,
            self.int8_activations,
            self.query_in_cache_dtype,
            *_lora_tables(batch.lora),
        )


def _attention_tables(batch: ForwardBatch) -> tuple[Tensor, Tensor]:
    """(block tables, context lengths) with one row per token: each token's own where the
    batch has them (per-token attention), else the decode rows' (one token per sequence)."""
    if batch.token_block_tables is not None and batch.token_context_lens is not None:
        return batch.token_block_tables, batch.token_context_lens
    return batch.decode_block_tables, batch.decode_context_lens


def _lora_tables(
    lora: LoraBatch | None,
) -> tuple[list[Tensor], list[Tensor], Tensor | None, Tensor | None, Tensor | None]:
    """The op's LoRA arguments: every layer's A and B of each projection (the slots' own
    [layers, slots, ...] tensors, in the op's projection order), the scales and the batch's
    segment table; empty lists and None without adapter rows."""
    if lora is None:
        return [], [], None, None, None
    slots = lora.slots
    return (
        [slots.lora_a[projection] for projection in PROJECTIONS],
        [slots.lora_b[projection] for projection in PROJECTIONS],
        slots.scales,
        lora.seg_starts,
        lora.seg_slots,
    )
