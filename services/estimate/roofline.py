"""Roofline estimate of decode serving on a device, the seeds' hardware-selection table: for a
model shape, a device and a context length, how many requests fit beside the weights, how long
one decode step takes if compute or memory traffic were the only limit, and the tokens/s and
cost that follow. Pure arithmetic, no I/O: `llmserve estimate` (command.py) prints it.

One decode step with B requests, each holding `context_len` tokens of KV cache (the upper bound
the seeds use: every request at full context):

    compute latency = B * decode FLOPs per token / peak FLOP/s
    memory latency  = (weight bytes + B * context_len * KV bytes per token) / bandwidth
    step latency    = max(compute latency, memory latency)        (perfect overlap)
    throughput      = B / step latency                            tokens/s

    decode FLOPs per token = 2 * matmul parameters    (one multiply-add per weight)
                           + 4 * layers * heads * head_dim * context    (QK^T and PV)

Units: GB and GB/s are decimal (1e9), as on datasheets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9

# Bytes per stored value. Quantized formats count their payload only: group scales add a few
# percent (int4 with fp16 scales per 128 weights: +1.6%), which this estimate ignores.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}


def dtype_bytes(name: str) -> float:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}; got {name!r}") from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs of a Llama-family decoder."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False

    @property
    def linear_params_per_layer(self) -> int:
        """q, k, v, o projections and the three SwiGLU matrices (gate, up, down)."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q_and_o + k_and_v + mlp

    @property
    def small_params(self) -> int:
        """RMSNorm weights (two per layer, one final) and q/k/v biases (Qwen2)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        biases = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return norms + (self.num_layers * biases if self.attention_bias else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        embeddings = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.linear_params_per_layer + embeddings + self.small_params

    @property
    def matmul_params(self) -> int:
        """Weights a decode token multiplies: every linear layer plus the LM head (the
        embedding matrix itself when tied); the embedding lookup and the norms cost no matmul."""
        return self.num_layers * self.linear_params_per_layer + self.embedding_params


@dataclass(frozen=True, slots=True)
class Device:
    """A GPU (or any device) as the estimate sees it."""

    name: str
    memory_gb: float
    bandwidth_gb_s: float
    tflops: float
    """Dense 16-bit tensor throughput, no sparsity."""
    usd_per_hour: float | None = None


@dataclass(frozen=True, slots=True)
class Estimate:
    device: Device
    weight_bytes: float
    kv_bytes_per_token: float
    context_len: int
    max_requests: int
    """Requests at full context that fit beside the weights (0: the weights alone do not fit)."""
    batch: int
    """Requests per decode step: max_requests unless capped."""
    compute_latency_s: float
    memory_latency_s: float

    @property
    def step_latency_s(self) -> float:
        if self.batch == 0:
            return math.nan
        return max(self.compute_latency_s, self.memory_latency_s)

    @property
    def bound(self) -> str:
        if self.batch == 0:
            return "does not fit"
        return "compute" if self.compute_latency_s > self.memory_latency_s else "memory"

    @property
    def tokens_per_s(self) -> float:
        return decode_throughput(self.batch, self.step_latency_s)

    @property
    def usd_per_million_tokens(self) -> float:
        price = self.device.usd_per_hour
        if price is None or not self.tokens_per_s > 0:
            return math.nan
        return price / (self.tokens_per_s * 3600) * 1e6


def weight_bytes(model: ModelShape, weight_dtype: str) -> float:
    return model.num_params * dtype_bytes(weight_dtype)


def kv_bytes_per_token(model: ModelShape, kv_dtype: str) -> float:
    """K and V, every layer, every KV head: 2 * layers * kv_heads * head_dim * bytes."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes(kv_dtype)


def decode_flops_per_token(model: ModelShape, context_len: int) -> float:
    attention = 4 * model.num_layers * model.num_heads * model.head_dim * context_len
    return 2 * model.matmul_params + attention


def max_concurrent_requests(
    memory_bytes: float, weights: float, kv_per_token: float, context_len: int
) -> int:
    """Requests of `context_len` tokens whose KV cache fits in what the weights leave."""
    free = memory_bytes - weights
    if free <= 0:
        return 0
    return int(free // (kv_per_token * context_len))


def compute_latency_s(batch: int, flops_per_token: float, tflops: float) -> float:
    return batch * flops_per_token / (tflops * 1e12)


def memory_latency_s(
    batch: int, weights: float, kv_per_token: float, context_len: int, bandwidth_gb_s: float
) -> float:
    """Every weight and every live KV entry is read once per step."""
    return (weights + batch * context_len * kv_per_token) / (bandwidth_gb_s * GB)


def decode_throughput(batch: int, step_latency_s: float) -> float:
    """Tokens/s: one token per request per step."""
    return batch / step_latency_s if step_latency_s > 0 else math.nan


def estimate(
    model: ModelShape,
    device: Device,
    context_len: int = 4096,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    memory_utilization: float = 0.9,
    max_batch: int | None = None,
) -> Estimate:
    """The seeds' table row for one device. `memory_utilization` is the share of device memory
    the server may use (vLLM's default 0.9 leaves the rest to activations and the runtime)."""
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    weights = weight_bytes(model, weight_dtype)
    kv_per_token = kv_bytes_per_token(model, kv_dtype)
    usable = device.memory_gb * GB * memory_utilization
    fitting = max_concurrent_requests(usable, weights, kv_per_token, context_len)
    batch = fitting if max_batch is None else min(fitting, max_batch)
    flops = decode_flops_per_token(model, context_len)
    return Estimate(
        device=device,
        weight_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        context_len=context_len,
        max_requests=fitting,
        batch=batch,
        compute_latency_s=compute_latency_s(batch, flops, device.tflops),
        memory_latency_s=(
            memory_latency_s(batch, weights, kv_per_token, context_len, device.bandwidth_gb_s)
            if batch
            else math.nan
        ),
    )


def speed_of_light_tokens_per_s(bytes_per_step: float, bandwidth_bytes_s: float) -> float:
    """Batch-1 decode ceiling on a memory-bound device: one token per full read."""
    return bandwidth_bytes_s / bytes_per_step
