"""Batch-invariant mode (--deterministic): a sequence's logits depend only on its own tokens.

Without it, greedy output can depend on what a request is batched with: the GGUF kernels of
Q4 blocks in the file's layout take another arithmetic path from 16 rows on, a GEMM library
picks its blocking from M, decode attention splits long contexts by the batch's total length,
a prompt's attention depends on how it was chunked or how much of it came from the prefix
cache, and a compiled or fused decode step rounds differently from the eager ops of a step
that also holds a prefill. In this mode:

    linear layers   GGUF blocks: one kernel path at every M (kernels/csrc/gguf_gemm.cpp; the
                    8-row layouts always are); float weights: GEMM calls of one fixed tile
                    shape (kernels/batch_invariant_torch.py)
    attention       every token, prefill ones too, is a decode query over the paged cache,
                    its context split by its own length only (services/worker/input_batch.py
                    builds its block table row)
    steps           one path for every step: the fused C++ layers where the projections are
                    GGUF blocks with int8 activations (a prefill token is one more row of the
                    call), else eager (no fused or compiled decode) (services/worker/runner.py)

On a CPU worker serving a GGUF file (int8 activations) the mode costs nothing, and is on
unless --no-deterministic: the fused call is the fast path for decode steps already, and a
prefill token's attention as a decode query is a small part of a prefill's work on a CPU. Steps
with LoRA rows run the fused layers too: the adapter delta's kernel sums each row on its own.

Row-wise ops (norms, rotary, SiLU, embedding lookups, argmax) are already invariant; the unit
tests check every layer type row by row against batches of other sizes
(tests/kernels/test_batch_invariance.py), and tests/model/test_deterministic.py a probe alone
against the same probe among 16 busy requests.

The smallest difference counts: a GGUF tile of 1-2 rows and one of 3-4 rows once added each
block's offset term with a fused multiply-add in one and a multiply then an add in the other,
one fp32 rounding apart, and that was enough to turn a greedy token 30 positions later.
"""

from __future__ import annotations

from torch import Tensor, nn

from kernels import batch_invariant_torch
from services.contracts.errors import ModelLoadError
from services.worker.model.causal_lm import CausalLM
from services.worker.quantization.gguf_linear import GGUFLinear
from services.worker.quantization.linear import QuantizedLinear


class BatchInvariantLinear(nn.Module):
    """nn.Linear computed in GEMM tiles of one shape (same weight and bias objects)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        out = batch_invariant_torch.linear(flat, self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def make_batch_invariant(model: CausalLM) -> None:
    """Switch every linear layer of `model` to its batch-invariant form, in place.

    Raises ModelLoadError for what has no batch-invariant path: a CUDA device (the Triton
    decode attention splits by batch) and the weight formats other than GGUF blocks and
    plain float."""
    if model.norm.device.type != "cpu":
        raise ModelLoadError("batch-invariant mode is implemented for CPU workers only")
    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, GGUFLinear):
                child.batch_invariant = True
            elif isinstance(child, nn.Linear):
                replacements.append((parent, name, BatchInvariantLinear(child)))
            elif isinstance(child, QuantizedLinear):
                raise ModelLoadError(
                    f"batch-invariant mode supports GGUF blocks and float weights, not "
                    f"{type(child).__name__} ({name}); serve with --quantization none or a GGUF"
                )
    for parent, name, replacement in replacements:
        setattr(parent, name, replacement)
