"""How far the fused decode step (kernels/csrc/llama_decode.cpp) may land from the eager model
it replaces, derived from the arithmetic of the two, for the keys and values a step writes
and for its logits.

Where the two paths differ. Both run the same kernels for every product (gguf_linear or the
dense matmul), the KV write and the attention; they round differently only in the ops between:
the norms' sums of squares (torch's vectorized reduction against the C++ loop, whose order
also depends on the vector width: 16 lanes on AVX-512, 8 on AVX2), the rotary (the C++ loop
may fuse a multiply and an add) and exp / tanh in the gating (~1-2 ulp apart). So the row a
product reads (the normed hidden state, the attention output, the gated activation) differs
between the paths by a small relative amount in norm, ||dx|| <= eps ||x||; each layer adds a
few units of roundoff u = 2^-24 to it, and the products and the attention carry it on.

What that does to an output. A product y_i = W_i . x moves by |W_i . dx| <= ||W_i|| ||dx|| <=
eps ||W_i|| ||x|| (Cauchy-Schwarz), whatever y_i itself is: a sum that cancels keeps the
absolute error of its terms. That is why a relative bound on each value fails where one
cancels: on AVX-512 a key of -1.12 in a row of keys up to 990 came out 2.5e-4 apart, 2.2e-4
relative to itself but 1.6e-8 (0.27 u) of its scale ||W_i|| ||x|| (1.6e4, summed over its
rotary pair); the AVX2 build sums the norms in another order and happened to leave that key
closer. Then:

- QK-norm n = w * k / r, r = sqrt(mean(k^2) + eps_norm) over a head (or all heads): with
  dr = (k . dk) / (n r), |dn_i| <= |w_i| (|dk_i| + |k_i| ||dk|| / (sqrt(n) r)) / r.
- the rotary mixes dims i and i + R/2 with cos and sin: |d rot_i| <= |dk_i| + |dk_(i+R/2)|.
- the ops after the last product (a norm, the rotary) round once more: eps |value|.
- a float16 / bfloat16 cache rounds both paths' values: one step of its format more,
  finfo.eps * |value|; an int8 cache stores codes value / scale rounded to the nearest: the
  codes may then differ by the bound over the scale, plus one where a value sits on a
  rounding boundary.
- logits are the vocabulary product of the final norm's row: eps ||W_i|| ||x||, divided by
  the logits divisor; the final soft-cap c tanh(l / c) has slope <= 1.

ROW_EPSILON, the eps above, is the one number not derived, and it is checked rather than
assumed: every comparison asserts it on the last row the two paths share, the final norm's
output (the vocabulary's input), where the difference has grown through every layer. Each
layer rounds ~10 ops differently by ~u, and passes the difference it receives on amplified
by its conditioning: the softmax of the tests' random models over random caches turns a
one-u perturbation of the embedding into 1e-6 to 1e-5 of the last layer's row, eager against
itself. Measured between the paths: up to 1.2e-5 (Phi-3, dense, 4 layers); eps = 2^-14
(6.1e-5, 1024 u) leaves 5x. Models far from a trained one's scale need more: random K-quant
blocks with row norms of 200 give attention scores of 1e4, 300-fold amplification in one
layer (tests/kernels/test_llama_decode_families.py scales them down). A float16 or int8
cache adds a step of its format to the values it stores (below), which attention spreads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kernels.gguf_blocks_torch import dequantize_blocks
from services.worker.forward_batch import ForwardBatch
from services.worker.model.causal_lm import CausalLM
from services.worker.quantization.gguf_linear import GGUFLinear

ROW_EPSILON = 2.0**-14


@dataclass
class EagerRows:
    """The rows the eager forward fed its products, recorded by hooks: each layer's q|k|v
    input (the normed hidden state) and the final norm's output (the vocabulary's input)."""

    qkv_inputs: dict[int, Tensor] = field(default_factory=dict)
    head_inputs: list[Tensor] = field(default_factory=list)


@contextmanager
def recorded_rows(model: CausalLM) -> Iterator[EagerRows]:
    """Records the rows of the eager forward run inside the block. The fused step calls no
    layer module, only the vocabulary product after the eager one: head_inputs[0] is eager's."""
    rows = EagerRows()

    def qkv_hook(index: int) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
        def hook(_: nn.Module, args: tuple[Tensor, ...]) -> None:
            rows.qkv_inputs[index] = args[0].detach().float().clone()

        return hook

    def head_hook(_: nn.Module, args: tuple[Tensor, ...]) -> None:
        rows.head_inputs.append(args[0].detach().float().clone())

    handles = [
        layer.self_attn.qkv_proj.register_forward_pre_hook(qkv_hook(index))
        for index, layer in enumerate(model.layers)
    ]
    handles.append(model.lm_head.register_forward_pre_hook(head_hook))
    try:
        yield rows
    finally:
        for handle in handles:
            handle.remove()


def dense_weight(linear: nn.Module) -> Tensor:
    """The fp32 weight [out, in] a projection multiplies by (GGUF blocks dequantized)."""
    if isinstance(linear, GGUFLinear):
        return torch.cat(
            [
                dequantize_blocks(part, kind)
                for part, kind in zip(linear.parts, linear.kinds, strict=True)
            ]
        )
    assert isinstance(linear, nn.Linear)
    return linear.weight.detach().float()


def row_weights(model: CausalLM, batch: ForwardBatch, layer: int) -> Tensor:
    """[B, out, in]: the q|k|v weight each row multiplies by, its adapter's B A added (scaled)
    for a row with a LoRA slot."""
    weight = dense_weight(model.layers[layer].self_attn.qkv_proj)
    rows = weight.expand(batch.input_ids.shape[0], *weight.shape).clone()
    lora = batch.lora
    if lora is not None:
        slots = lora.slots
        for row, slot in enumerate(lora.row_slots(rows.shape[0]).tolist()):
            if slot >= 0:
                lora_a = slots.lora_a["qkv"][layer, slot].float()
                lora_b = slots.lora_b["qkv"][layer, slot].float()
                rows[row] += slots.scales[slot] * lora_b @ lora_a
    return rows


def _norm_bound(values: Tensor, bound: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(normed values, their bound) of an RMSNorm over the last dim, from the values' bound."""
    size = values.shape[-1]
    r = torch.sqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    spread = bound.norm(dim=-1, keepdim=True) / (math.sqrt(size) * r)
    return values / r * weight, weight.abs() * (bound + values.abs() * spread) / r


def _rotary_bound(bound: Tensor, rotary_dim: int) -> Tensor:
    """Each rotated dim mixes its pair's two errors."""
    half = rotary_dim // 2
    mixed = bound[..., :half] + bound[..., half:rotary_dim]
    return torch.cat([mixed, mixed, bound[..., rotary_dim:]], dim=-1)


def kv_bounds(model: CausalLM, batch: ForwardBatch, rows: EagerRows) -> list[Tensor]:
    """Per layer, the bound [B, 2 (key, value), Hkv, D] on how far the fused step's key and
    value of each row may be from eager's, before the cache's own rounding."""
    arch = model.architecture
    q_size = arch.num_heads * arch.head_dim
    kv_size = arch.num_kv_heads * arch.head_dim
    bounds = []
    for index, layer in enumerate(model.layers):
        attention = layer.self_attn
        x = rows.qkv_inputs[index]
        weights = row_weights(model, batch, index)
        qkv = torch.einsum("boi,bi->bo", weights, x)
        if attention.qkv_proj.bias is not None:
            qkv = qkv + attention.qkv_proj.bias.float()
        bound = ROW_EPSILON * weights.norm(dim=-1) * x.norm(dim=-1, keepdim=True)
        key = qkv[:, q_size : q_size + kv_size]
        key_bound = bound[:, q_size : q_size + kv_size]
        value_bound = bound[:, q_size + kv_size :]
        heads = (-1, arch.num_kv_heads, arch.head_dim)
        if arch.qk_norm != "none":
            assert attention.k_norm is not None
            groups = (-1, arch.num_kv_heads, arch.head_dim)
            if arch.qk_norm == "across_heads":
                groups = (-1, 1, kv_size)
            _, key_bound = _norm_bound(
                key.reshape(groups),
                key_bound.reshape(groups),
                attention.k_norm.float(),
                arch.rms_norm_eps,
            )
        key_bound = key_bound.reshape(heads)
        if arch.uses_rope(index):
            key_bound = _rotary_bound(key_bound, model.layer_rope(index).shape[-1])
        bounds.append(torch.stack([key_bound, value_bound.reshape(heads)], dim=1))
    return bounds


def slot_rows(storage: Tensor) -> Tensor:
    """[L, 2, num_blocks * block_size, ...]: a cache (or its scales) by slot."""
    return storage.reshape(*storage.shape[:2], -1, *storage.shape[-2:])


def assert_kv_within_bounds(
    model: CausalLM,
    batch: ForwardBatch,
    rows: EagerRows,
    before: Tensor,
    after_eager: Tensor,
    after_fused: Tensor,
    fused_scales: Tensor | None,
) -> None:
    """Both paths write the batch's slots and nothing else, and each written key and value
    within its bound (the module's docstring) of the other's."""
    slots = batch.slot_mapping.long()
    untouched = torch.ones(slot_rows(before).shape[2], dtype=torch.bool)
    untouched[slots] = False
    for after in (after_eager, after_fused):
        assert torch.equal(slot_rows(after)[:, :, untouched], slot_rows(before)[:, :, untouched])
    bound = torch.stack(kv_bounds(model, batch, rows)).transpose(1, 2)  # [L, 2, B, Hkv, D]
    eager = slot_rows(after_eager)[:, :, slots].float()
    fused = slot_rows(after_fused)[:, :, slots].float()
    dtype = after_eager.dtype
    if dtype == torch.int8:
        assert fused_scales is not None
        scales = slot_rows(fused_scales)[:, :, slots].float()
        scales = scales.repeat_interleave(eager.shape[-1] // scales.shape[-1], dim=-1)
        # Codes: the value's bound over the scale, and one more across a rounding boundary.
        allowed = 1.0 + bound / scales.clamp_min(torch.finfo(torch.float32).tiny)
    else:
        allowed = bound + ROW_EPSILON * eager.abs()
        if dtype != torch.float32:
            allowed = allowed + torch.finfo(dtype).eps * (eager.abs() + allowed)
    _assert_within("K/V", (fused - eager).abs(), allowed)


def logits_bound(model: CausalLM, rows: EagerRows, eager: Tensor) -> Tensor:
    """[B, vocab]: eps ||W_i|| ||x|| / divisor, x the final norm's row, and eps of the value
    itself for the ops after the product."""
    x = rows.head_inputs[0]
    weight = model.lm_head.weight.detach().float()
    bound = ROW_EPSILON * x.norm(dim=-1, keepdim=True) * weight.norm(dim=-1)
    return bound / model.architecture.logits_divisor + ROW_EPSILON * eager.abs()


def assert_logits_within_bounds(
    model: CausalLM, rows: EagerRows, eager: Tensor, fused: Tensor
) -> None:
    """The final norm's rows within ROW_EPSILON of eager's (the bounds' premise), and the
    logits within their bound."""
    assert len(rows.head_inputs) == 2, "record the eager forward, then the fused step"
    eager_row, fused_row = rows.head_inputs
    relative = (fused_row - eager_row).norm(dim=-1) / eager_row.norm(dim=-1)
    assert relative.max() <= ROW_EPSILON, f"final rows {relative.max():.3g} apart (relative)"
    _assert_within("logits", (fused - eager).abs(), logits_bound(model, rows, eager))


def _assert_within(what: str, gap: Tensor, bound: Tensor) -> None:
    """gap <= bound everywhere (a zero bound, a projection row of zero blocks, needs gap 0)."""
    outside = gap > bound
    if outside.any():
        worst = (gap[outside] / bound[outside]).max().item()
        raise AssertionError(
            f"{what}: {int(outside.sum())} values past their bound, up to {worst:.3g} times it "
            f"(largest gap {gap.max().item():.3g})"
        )
