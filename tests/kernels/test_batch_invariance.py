"""Batch-invariant kernels (--deterministic): a row computed inside a batch of any size, at
any position, is bit for bit the row computed alone. Fresh random inputs; each kernel is
also checked against its torch reference, so invariance is not bought with a wrong answer.

Every layer type the batch-invariant model runs is covered: GGUF linear layers (every kind,
fp32 and bf16, every C++ build), float linear layers, decode attention (C++ and torch, with
and without a sliding window) on contexts long enough that the default schedule would split
them, and the row-wise ops.
"""

from __future__ import annotations

import pytest
import torch

from kernels import batch_invariant_torch, cpu_extension, gguf_blocks_torch, ops
from kernels.attention_torch import paged_decode_attention as torch_decode_attention
from kernels.gguf_blocks_torch import GGUF_Q4_0, GGUF_Q4_1, GGUF_Q8_0, dequantize_blocks
from tests.kernels.paged_kv_factory import make_paged_kv
from tests.kernels.test_gguf_gemm import (  # noqa: F401  (fixtures)
    BUILDS,
    activations,
    avx2_extension,
    avx512_no_vnni_extension,
    extension,
    random_blocks,
    scalar_extension,
    vnni_emulated_extension,
)

# Batch sizes that reach every tile height (1-4), the M >= 8 and M >= 16 switches of the
# default path, and ragged remainders.
BATCH_SIZES = [1, 2, 3, 4, 5, 8, 15, 16, 17, 33]
KINDS = [GGUF_Q4_0, GGUF_Q4_1, GGUF_Q8_0]


def assert_rows_invariant(compute, x: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """compute(x[a:b]) must equal compute(x)[a:b] bit for bit, for every size and offset."""
    full = compute(x)
    for size in BATCH_SIZES:
        for start in sorted({0, 1, x.shape[0] - size}):
            if start < 0 or start + size > x.shape[0]:
                continue
            part = compute(x[start : start + size])
            expected = full[start : start + size]
            difference = (part.float() - expected.float()).abs().max()
            assert torch.equal(part, expected), (
                f"rows {start}..{start + size} differ from the same rows in a batch of "
                f"{x.shape[0]}: max |diff| {difference}"
            )


@pytest.fixture(params=list(BUILDS))
def gguf_ops(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return request.getfixturevalue(BUILDS[request.param])


@pytest.mark.parametrize("kind", KINDS, ids=["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gguf_linear_rows_do_not_depend_on_the_batch(gguf_ops, kind: int, dtype) -> None:  # type: ignore[no-untyped-def]
    k, n = 576, 200
    blocks = random_blocks(n, k, kind, seed=kind * 7 + 1)
    x = activations(40, k, seed=kind + 11).to(dtype)

    def compute(rows: torch.Tensor) -> torch.Tensor:
        return gguf_ops.gguf_linear(rows, blocks, kind, False, True)

    assert_rows_invariant(compute, x)
    # Still the layer's product: fp32 exact up to summation order; bf16 the int8-rounded
    # activations' product up to the output rounding.
    weight = dequantize_blocks(blocks, kind).double()
    rounded = gguf_blocks_torch.quantize_activation_blocks(x)
    x_used = x.double() if dtype == torch.float32 else rounded.double()
    expected = x_used @ weight.t()
    magnitude = x_used.abs() @ weight.abs().t()
    rtol = 1e-6 if dtype == torch.float32 else 2.0**-8
    error = (compute(x).double() - expected).abs()
    assert bool((error <= rtol * expected.abs() + 1e-5 * magnitude + 1e-6).all())


@pytest.mark.parametrize("kind", KINDS, ids=["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_int8_tiles_agree_in_fp32(gguf_ops, kind: int) -> None:  # type: ignore[no-untyped-def]
    """The int8 path bf16 serving takes, read before its output is rounded to bf16: in fp32
    a single rounding that one tile height makes and another does not (a multiply-add fused
    in one kernel only) shows in most rows, where bf16 output hides it in all but a few."""
    k, n = 576, 256
    blocks = random_blocks(n, k, kind, seed=kind * 5 + 3)
    x = activations(40, k, seed=kind + 17)

    def compute(rows: torch.Tensor) -> torch.Tensor:
        return gguf_ops.gguf_linear(rows, blocks, kind, True, True)

    assert_rows_invariant(compute, x)


@pytest.mark.parametrize("kind", KINDS, ids=["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_linear_torch_fallback_is_batch_invariant(kind: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("LLMSERVE_KERNEL_BACKEND", "torch")
    blocks = random_blocks(64, 96, kind, seed=3)
    x = activations(40, 96, seed=4).to(torch.bfloat16)
    assert_rows_invariant(lambda rows: ops.gguf_linear(rows, blocks, kind, batch_invariant=True), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_float_linear_in_fixed_tiles_is_batch_invariant(dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(1536, 576, generator=g).to(dtype)
    bias = torch.randn(1536, generator=g).to(dtype)
    x = torch.randn(40, 576, generator=g).to(dtype)
    assert_rows_invariant(lambda rows: batch_invariant_torch.linear(rows, weight, bias), x)
    torch.testing.assert_close(
        batch_invariant_torch.linear(x, weight, bias),
        torch.nn.functional.linear(x, weight, bias),
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=2e-2 if dtype == torch.bfloat16 else 1e-4,
    )


def decode_case(dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    """12 sequences, contexts from 1 to 900 tokens (long ones are split by the default
    schedule on 2+ threads), GQA 9 query heads over 3 KV heads, head dim 64."""
    g = torch.Generator().manual_seed(seed)
    lens = [900, 1, 17, 300, 129, 640, 5, 256, 33, 700, 64, 411]
    kv = make_paged_kv(lens, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype, generator=g)
    query = torch.randn(len(lens), 9, 64, generator=g).to(dtype)
    return query, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["cpp", "torch"])
@pytest.mark.parametrize("sliding_window", [0, 300], ids=["full", "window"])
def test_decode_attention_rows_do_not_depend_on_the_batch(
    dtype, path: str, sliding_window: int
) -> None:  # type: ignore[no-untyped-def]
    if path == "cpp":
        assert cpu_extension.load(), "the C++ kernels must build on this machine"
    query, kv = decode_case(dtype, seed=8)

    def compute(rows: slice) -> torch.Tensor:
        args = (query[rows], kv.k_cache, kv.v_cache, kv.block_tables[rows], kv.lens[rows], 0.125)
        if path == "cpp":
            return torch.ops.llmserve.paged_decode_attention(
                *args, None, None, True, sliding_window
            )
        return torch_decode_attention(*args, batch_invariant=True, sliding_window=sliding_window)

    full = compute(slice(None))
    for size in [1, 2, 3, 5, 12]:
        for start in range(0, len(kv.lens) - size + 1, 3):
            part = compute(slice(start, start + size))
            assert torch.equal(part, full[start : start + size]), f"rows {start}+{size}"
    reference = torch_decode_attention(
        query,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        kv.lens,
        0.125,
        sliding_window=sliding_window,
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(full, reference, rtol=tol, atol=tol)


def test_row_wise_ops_do_not_depend_on_the_batch() -> None:
    """The ops the model runs between the matmuls, in bf16: norms, SiLU-and-mul, rotary."""
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(40, 576, generator=g).to(torch.bfloat16)
    residual = torch.randn(40, 576, generator=g).to(torch.bfloat16)
    weight = torch.randn(576, generator=g).to(torch.bfloat16)
    gate_up = torch.randn(40, 3072, generator=g).to(torch.bfloat16)
    assert_rows_invariant(lambda rows: ops.rms_norm(rows, weight, 1e-5), hidden)
    assert_rows_invariant(ops.silu_and_mul, gate_up)
    assert_rows_invariant(
        lambda rows: torch.cat(
            ops.fused_add_rms_norm(rows[:, :576], rows[:, 576:], weight, 1e-5), dim=1
        ),
        torch.cat([hidden, residual], dim=1),
    )
    from services.worker.model.architecture import RopeConfig
    from services.worker.model.rope import cos_sin_cache

    cache = cos_sin_cache(RopeConfig(theta=10000.0), 64, 2048)
    # Each row carries its own position (column 0 of the last head), so a slice of rows is
    # rotated with its own positions.
    q = torch.randn(40, 9, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(40, 3, 64, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 2048, (40,), generator=g)

    def rotate(rows: torch.Tensor) -> torch.Tensor:
        index = rows[:, 0, 0].long()
        q_rows, k_rows = q[index].clone(), k[index].clone()
        q_rows, k_rows = ops.apply_rotary(q_rows, k_rows, positions[index], cache)
        return torch.cat([q_rows, k_rows], dim=1)

    row_index = torch.arange(40, dtype=torch.float64).view(40, 1, 1)
    assert_rows_invariant(rotate, row_index)


@pytest.mark.skipif(not cpu_extension.load(), reason="no C++ CPU kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_delta_rows_do_not_depend_on_the_batch(dtype) -> None:  # type: ignore[no-untyped-def]
    """A row's adapter delta (the C++ op the fused layers call) is the same alone, in a long
    segment of its adapter (a prefill) and among other adapters' and the base's rows."""
    from services.worker.lora.batch import segment_table

    g = torch.Generator().manual_seed(21)
    num_rows, k, n, rank, num_slots = 40, 576, 200, 8, 3
    x = torch.randn(num_rows, k, generator=g).to(dtype)
    lora_a = (torch.randn(num_slots, rank, k, generator=g) / k**0.5).to(dtype)
    lora_b = (torch.randn(num_slots, n, rank, generator=g) * 0.1).to(dtype)
    scales = torch.tensor([2.0, 0.5, 1.0])
    base = torch.randn(num_rows, n, generator=g).to(dtype)
    # Runs of one slot as a step lays them out: a long prefill run, decode rows, base rows.
    row_slots = [0] * 17 + [1, 2, -1, 0, 0, 1] + [-1] * 5 + [2] * 12

    def apply(rows: torch.Tensor) -> torch.Tensor:
        index = rows[:, 0].long()
        starts, slots = segment_table([(1, row_slots[i]) for i in index.tolist()])
        y = base[index].clone()
        ops.lora_apply(
            x[index],
            lora_a,
            lora_b,
            torch.tensor(starts, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int32),
            scales,
            y,
        )
        return y

    row_index = torch.arange(num_rows, dtype=torch.float64).view(num_rows, 1)
    assert_rows_invariant(apply, row_index)
    # Not bought with a wrong answer: each row against its own adapter's product.
    full = apply(row_index)
    for i, slot in enumerate(row_slots):
        want = base[i].float()
        if slot >= 0:
            want = (
                want
                + scales[slot] * (x[i].float() @ lora_a[slot].float().T) @ lora_b[slot].float().T
            )
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(full[i].float(), want, rtol=tol, atol=tol)
