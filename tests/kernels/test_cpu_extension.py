"""The C++ CPU paged decode attention against the torch reference, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import attention_torch, cpu_extension

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.fixture(scope="module")
def extension():  # type: ignore[no-untyped-def]
    assert cpu_extension.load(), "the C++ kernels must build on this machine (gcc, ninja)"
    return cpu_extension.ops()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("lengths", [[1], [17, 1, 40, 16], [129, 3, 64]])
def test_paged_decode_attention_matches_torch(
    extension,
    dtype: torch.dtype,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    lengths: list[int],
) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(hash((head_dim, num_q_heads, len(lengths))) % 2**31)
    block_size, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    width = max(-(-n // block_size) for n in lengths)
    # Distinct random blocks per sequence, padded with block 0 (never read past the length).
    block_tables = (
        torch.randperm(num_blocks, generator=g)[: len(lengths) * width]
        .view(len(lengths), width)
        .to(torch.int32)
    )
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    query = torch.randn(len(lengths), num_q_heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    expected = attention_torch.paged_decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, scale
    )
    got = extension.paged_decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, scale
    )
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])


def test_ops_use_the_extension_on_cpu(extension, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from kernels import backend

    monkeypatch.delenv(backend.BACKEND_ENV_VAR, raising=False)
    assert backend.use_cpu_extension(torch.zeros(1))
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "torch")
    assert not backend.use_cpu_extension(torch.zeros(1))
