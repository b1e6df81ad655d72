"""Drop-in replacements for nn.Linear / nn.Embedding that hold quantized weights as buffers.

Each module keeps exactly the tensors its kernel reads (so `weight_bytes` is the real
footprint) and calls one op of `kernels.ops`. They are built from a float weight by
`from_float`, or from codes that are already quantized (a GGUF file) by their constructors.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels import ops
from kernels.quant_weight_only_torch import (
    pack_int4_for_cpu,
    quantize_int4_codes,
    quantize_int8_weight,
    quantize_nf4,
)


class QuantizedLinear(nn.Module):
    """Common shape bookkeeping: x [..., in_features] -> [..., out_features]."""

    in_features: int
    out_features: int
    bias: Tensor | None

    def _matmul(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        out = self._matmul(flat)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8WeightOnlyLinear(QuantizedLinear):
    """int8 weights, one scale per output channel; activations stay in the model dtype."""

    def __init__(self, w_q: Tensor, w_scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = w_q.shape
        self.register_buffer("w_q", w_q)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None) -> Int8WeightOnlyLinear:
        w_q, w_scale = quantize_int8_weight(weight)
        # Scales in the activation dtype: what the packed kernel multiplies with.
        return cls(w_q, w_scale.to(weight.dtype), bias)

    def _matmul(self, x: Tensor) -> Tensor:
        return ops.int8_weight_only_gemm(x, self.w_q, self.w_scale)


class W8A8Linear(QuantizedLinear):
    """int8 weights per channel and int8 activations per token (scales computed per call);
    int8 x int8 -> int32 accumulation (torch._int_mm on CPU)."""

    def __init__(self, w_q: Tensor, w_scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = w_q.shape
        self.register_buffer("w_q", w_q)
        self.register_buffer("w_scale", w_scale.float())
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None) -> W8A8Linear:
        w_q, w_scale = quantize_int8_weight(weight)
        return cls(w_q, w_scale, bias)

    def _matmul(self, x: Tensor) -> Tensor:
        return ops.int8_gemm(x, self.w_q, self.w_scale)


class Int4Linear(QuantizedLinear):
    """int4 weight-only, asymmetric, grouped along K, in torch's CPU packed layout.

    With an fp32 model the packed kernel is slow, so the unpacked codes are kept instead and
    the layer dequantizes per call (see kernels/quant_weight_only_torch.py).
    """

    def __init__(
        self,
        codes: Tensor,
        scale: Tensor,
        zero: Tensor,
        bias: Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = self.in_features // scale.shape[1]
        packed, scales_and_zeros = pack_int4_for_cpu(codes, scale, zero, dtype)
        if dtype == torch.float32:
            self.register_buffer("packed", None)
            self.register_buffer("codes", codes.to(torch.uint8))
        else:
            self.register_buffer("packed", packed)
            self.register_buffer("codes", None)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None, group_size: int) -> Int4Linear:
        codes, scale, zero = quantize_int4_codes(weight, group_size)
        return cls(codes, scale, zero, bias, weight.dtype)

    def _matmul(self, x: Tensor) -> Tensor:
        return ops.int4_packed_gemm(
            x, self.packed, self.scales_and_zeros, self.group_size, self.codes
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class NF4Linear(QuantizedLinear):
    """4-bit normal-float codes with one absmax per group (dequantized per call)."""

    def __init__(self, packed: Tensor, absmax: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features = packed.shape[0]
        self.in_features = 2 * packed.shape[1]
        self.register_buffer("packed", packed)
        self.register_buffer("absmax", absmax)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None, group_size: int) -> NF4Linear:
        packed, absmax = quantize_nf4(weight, group_size)
        return cls(packed, absmax.to(torch.float16), bias)

    def _matmul(self, x: Tensor) -> Tensor:
        return ops.nf4_gemm(x, self.packed, self.absmax)


class Int8Embedding(nn.Module):
    """Token embedding from int8 rows with one scale per row: a lookup reads a few rows, so
    its format only matters for memory. May share its tensors with an int8 output layer."""

    def __init__(self, w_q: Tensor, w_scale: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = w_q.shape
        self.dtype = dtype
        self.register_buffer("w_q", w_q)
        self.register_buffer("w_scale", w_scale)

    @classmethod
    def from_float(cls, weight: Tensor) -> Int8Embedding:
        w_q, w_scale = quantize_int8_weight(weight)
        return cls(w_q, w_scale.to(weight.dtype), weight.dtype)

    def forward(self, token_ids: Tensor) -> Tensor:
        rows = self.w_q.index_select(0, token_ids.reshape(-1)).float()
        scales = self.w_scale.index_select(0, token_ids.reshape(-1)).float()
        out = (rows * scales[:, None]).to(self.dtype)
        return out.view(*token_ids.shape, self.embedding_dim)
