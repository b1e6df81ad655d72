"""Quantize a loaded float model in place by swapping its linear layers and its embedding.

What each format swaps (every layer's q|k|v, o, gate|up and down, plus the output layer):

    format  decoder linears            o_proj      lm_head + embedding
    int8    int8 weight-only           int8        int8 per row, one shared table when tied
    w8a8    W8A8                       float (*)   int8 per row, one shared table when tied
    int4    int4, group 32             int4        int8 per row, one shared table when tied
    nf4     NF4, group 64              NF4         int8 per row, one shared table when tied

(*) The O projection stays float under W8A8, as the seeds do: its input is the attention
output, whose per-token range is the least regular of the four, and it is the smallest
matmul (hidden x hidden), so keeping it costs little.
The output layer is int8 weight-only in every format: the logits are where rounding shows
most (on the embedded model an int4 head alone cost KL 0.04 nats and 7 points of top-1
agreement, and bought no measurable speed at batch 1), and a tied model then stores one
int8 table for both the lookup and the head.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from services.worker.model.causal_lm import CausalLM
from services.worker.quantization.formats import INT4_GROUP_SIZE, NF4_GROUP_SIZE
from services.worker.quantization.linear import (
    Int4Linear,
    Int8Embedding,
    Int8WeightOnlyLinear,
    NF4Linear,
    W8A8Linear,
)

LinearFactory = Callable[[Tensor, Tensor | None], nn.Module]

_FACTORIES: dict[str, LinearFactory] = {
    "int8": Int8WeightOnlyLinear.from_float,
    "w8a8": W8A8Linear.from_float,
    "int4": lambda w, b: Int4Linear.from_float(w, b, INT4_GROUP_SIZE),
    "nf4": lambda w, b: NF4Linear.from_float(w, b, NF4_GROUP_SIZE),
}


def _from_linear(factory: LinearFactory, linear: nn.Module) -> nn.Module:
    assert isinstance(linear, nn.Linear), f"expected nn.Linear, got {type(linear).__name__}"
    return factory(linear.weight.data, None if linear.bias is None else linear.bias.data)


def quantize_model(model: CausalLM, quantization: str) -> None:
    """Swap model's float layers for `quantization` ("int8", "w8a8", "int4" or "nf4")."""
    factory = _FACTORIES[quantization]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _from_linear(factory, attn.qkv_proj)
        if quantization != "w8a8":
            attn.o_proj = _from_linear(factory, attn.o_proj)
        mlp.gate_up_proj = _from_linear(factory, mlp.gate_up_proj)
        mlp.down_proj = _from_linear(factory, mlp.down_proj)
    quantize_output_and_embedding(model, Int8WeightOnlyLinear.from_float)


def quantize_output_and_embedding(model: CausalLM, head_factory: LinearFactory) -> None:
    """lm_head through `head_factory`, the embedding to int8 rows (shared when both are int8
    and the model ties them, so the tied table is stored once)."""
    embedding = model.embed_tokens
    assert isinstance(embedding, nn.Embedding)
    head = _from_linear(head_factory, model.lm_head)
    if isinstance(head, Int8WeightOnlyLinear) and model.architecture.tie_word_embeddings:
        model.embed_tokens = Int8Embedding(head.w_q, head.w_scale, embedding.weight.dtype)
    else:
        model.embed_tokens = Int8Embedding.from_float(embedding.weight.data)
    model.lm_head = head
